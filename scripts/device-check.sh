#!/usr/bin/env bash
# device-check.sh: the one command to run on a machine with an NVIDIA GPU.
#   - lists the GPUs (nvidia-smi -L) and the toolkit (nvcc --version)
#   - first: builds and runs tests/backend (every op of the backend table on CPU and CUDA against
#     its reference); a "skipped: no GPU" row is a failure here
#   - builds with USE_CUDA=1: the test binary and every benchmark
#   - runs build/tests/kvcc_tests (includes the CUDA-vs-CPU-reference equivalence tests; on this
#     machine they must run, so a "skipped: no GPU" line is a failure here)
#   - runs examples/serve_skeleton.c's policies on the GPU and on the CPU and compares them
#   - runs the Python binding's calls on a CUDA context (python/tests/cuda_calls.py) against the
#     CPU's, when python3 has numpy
#   - runs the CUDA attend tests once more under compute-sanitizer memcheck, and every backend op
#     (tests/backend) under memcheck and racecheck (when compute-sanitizer is installed and
#     supports the GPU)
#   - runs every build/bench/* whose source takes a --cuda flag, with --cuda
# Log: ${OUT:-build}/device-check.log (and the per-step logs beside it: 6 files at most, so that
# a device command's $OUT brings every one back; scratch files go to build/device-check.scratch).
# Time: the whole script stops within DEADLINE_S seconds (default 540: a device command may run
# 600 s); a step that would start past it is reported "not run (time budget spent)", so the
# summary is always printed. Exit status: 0 only when every step passed.
# Prebuilt: when build/device/bundle.tar.xz is there (scripts/device-bundle.sh, run on a machine
# that can build; carry build/device along), it is unpacked and used instead of building: the
# lent GPU machines are not described as having HDF5, OpenBLAS, oneDNN, Criterion..., nor a
# registry to install them from. USE_BUNDLE=0 builds anyway.
# Usage: bash scripts/device-check.sh            (from the repository root; JOBS=N to override)
#        EMU=1 bash scripts/device-check.sh      a rehearsal without a GPU: the same steps on
#        tests/cuda_emu's emulated CUDA plugin (KVRT_CUDA_LIBRARY), the CUDA tests only of
#        kvcc_tests, no compute-sanitizer, benchmarks at small sizes (timings meaningless): what
#        it checks is that every step runs and every comparison holds, so that the few minutes
#        a real GPU is lent go to the GPU's own findings
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
OUTDIR="${OUT:-build}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/device-check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
# the corpus, artifacts and inputs the steps make: not under $OUTDIR (a device command brings
# back at most 8 files of $OUT, 16 MiB each; the corpus alone is ~40 MB)
SCRATCH=build/device-check.scratch
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH"

JOBS="${JOBS:-$(nproc 2>/dev/null || echo 4)}"
FAILED=()
step() { echo; echo "== $*"; }
fail() { echo "FAILED: $*"; FAILED+=("$*"); }
EMU="${EMU:-0}"
# Every step is bounded, and all of them together by DEADLINE_S, so that the whole script fits in
# the 10 minutes one device command may run: a hung step costs its bound, not the summary.
DEADLINE_S="${DEADLINE_S:-$([ "$EMU" = 1 ] && echo 1800 || echo 540)}"
DEADLINE=$((SECONDS + DEADLINE_S))
NOT_RUN=199
# bounded N CMD...: CMD under timeout for at most N seconds and at most what is left of the budget
bounded() {
    local n=$1 left=$((DEADLINE - SECONDS))
    shift
    [ "$left" -lt "$n" ] && n=$left
    if [ "$n" -lt 10 ]; then
        echo "not run (the script's ${DEADLINE_S} s are spent): $*"
        return $NOT_RUN
    fi
    timeout -k 10 "$n" "$@"
}
# "timed out" for timeout's 124 / 137, "not run" when the budget was spent, else "exited with
# N": a hung or skipped step must not read as a finding
how() {
    case "$1" in
    124 | 137) echo "timed out" ;;
    "$NOT_RUN") echo "not run (time budget spent)" ;;
    *) echo "exited with $1" ;;
    esac
}
BUNDLE=build/device/bundle.tar.xz
PREBUILT=0
# build N [-k] TARGET...: make them (bounded by N seconds), or with a bundle check they are there
build() {
    local n=$1 t miss=()
    shift
    if [ "$PREBUILT" = 1 ]; then
        for t in "$@"; do [[ "$t" == -* ]] || [ -e "$t" ] || miss+=("$t"); done
        [ "${#miss[@]}" -eq 0 ] && return 0
        echo "not in the bundle: ${miss[*]} (bash scripts/device-bundle.sh builds them)"
        return 1
    fi
    bounded "$n" make -j"$JOBS" USE_CUDA=1 "$@"
}
step "machine"
date -u
uname -a
if [ -f "$BUNDLE" ] && [ "${USE_BUNDLE:-1}" != 0 ]; then
    echo "prebuilt: unpacking $BUNDLE (commit $(cat build/device/bundle.commit 2>/dev/null || echo '?'))"
    if tar -xJf "$BUNDLE" 2>/dev/null ||
       python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall()' "$BUNDLE"; then
        PREBUILT=1
        export LD_LIBRARY_PATH="$PWD/build/device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        # CUDA's libraries: the plugin's rpath names /usr/local/cuda/lib64; where the toolkit
        # keeps them elsewhere, the Python wheels' nvidia/*/lib hold the same sonames
        if ldd build/libkvrt_cuda.so 2>/dev/null | grep -q "not found"; then
            nv="$(python3 -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))' 2>/dev/null || true)"
            [ -n "$nv" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nv" && echo "CUDA libraries from $nv"
        fi
        nf="$(for f in build/tests/kvcc_tests build/tests/test_backend_ops build/kvcc build/libkvrt.so \
                 build/libkvrt_cuda.so; do ldd "$f" 2>/dev/null; done | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')"
        [ -z "$nf" ] && echo "prebuilt programs: every shared library found" ||
            fail "prebuilt programs cannot find: $nf"
    else
        fail "unpack $BUNDLE"
    fi
fi
if [ "$EMU" = 1 ]; then
    echo "EMU=1: a rehearsal on the CUDA emulation (tests/cuda_emu), no GPU used"
    if build 600 build/cuda_emu/libkvrt_cuda_emu.so; then
        export KVRT_CUDA_LIBRARY="$PWD/build/cuda_emu/libkvrt_cuda_emu.so"
    else
        fail "make build/cuda_emu/libkvrt_cuda_emu.so"
    fi
elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || fail "nvidia-smi -L"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true
else
    fail "nvidia-smi not found: no NVIDIA driver on this machine"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    command -v nvcc >/dev/null 2>&1 || export PATH="/usr/local/cuda/bin:$PATH"
    nvcc --version | tail -n 2
elif [ "$PREBUILT" = 0 ]; then
    fail "nvcc not found (install the CUDA toolkit or put it on PATH)"
fi
# the libraries the build links (scripts/install-deps.sh installs them on Debian); a machine
# that lacks one says so here, before a compile error further down does
missing=()
[ "$PREBUILT" = 1 ] || {
# (the cache read once: under pipefail, "ldconfig -p | grep -q" fails when grep stops reading
# early and ldconfig gets SIGPIPE; Debian's HDF5 is libhdf5_serial.so.N in the cache)
ldcache="$(ldconfig -p 2>/dev/null || true)"
for lib in libhdf5 libopenblas liblapacke libzstd libxxhash libcjson libcriterion libdnnl; do
    grep -q "$lib\(_serial\)\?\.so" <<<"$ldcache" || missing+=("$lib")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "missing libraries: ${missing[*]} (bash scripts/install-deps.sh; without oneDNN: USE_DNNL=0)"
    [[ " ${missing[*]} " == *" libdnnl "* ]] && export USE_DNNL=0
else
    echo "libraries: all found"
fi
}

step "backend ops (tests/backend, USE_CUDA=1)"
if build 300 build/tests/test_backend_ops; then
    BLOG="$OUTDIR/device-check.backend-ops.log"
    bounded 150 build/tests/test_backend_ops 2>&1 | tee "$BLOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || fail "test_backend_ops $(how "$rc")"
    if grep -q "skipped: no GPU" "$BLOG"; then
        fail "test_backend_ops skipped the CUDA rows on a machine that should have a GPU"
    fi
else
    fail "make USE_CUDA=1 build/tests/test_backend_ops"
fi

step "build (USE_CUDA=1)"
BENCH_BINS=()
for src in bench/*.c; do
    [ -e "$src" ] || continue
    BENCH_BINS+=("build/bench/$(basename "$src" .c)")
done
# -k: a target that fails (kvcc_tests without libcriterion, say) does not stop the others;
# build/libkvrt.so: the Python binding's library (nothing else here builds it)
if build 300 -k build/tests/kvcc_tests build/libkvrt.so build/kvcc \
       build/examples/serve_skeleton "${BENCH_BINS[@]}"; then
    echo "build ok"
else
    fail "make USE_CUDA=1 build/tests/kvcc_tests build/libkvrt.so build/kvcc build/examples/serve_skeleton ${BENCH_BINS[*]}"
fi

step "tests: build/tests/kvcc_tests"
if [ -x build/tests/kvcc_tests ]; then
    TLOG="$OUTDIR/device-check.tests.log"
    TFILTER=()
    [ "$EMU" = 1 ] && TFILTER=(--filter 'cuda/*') # the emulation is slow: its CUDA tests only
    KVCC_BUILD=build bounded 240 build/tests/kvcc_tests --jobs "$JOBS" "${TFILTER[@]}" 2>&1 | tee "$TLOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || fail "kvcc_tests $(how "$rc")"
    if grep -q "skipped: no GPU" "$TLOG"; then
        fail "CUDA tests were skipped on a machine that should have a GPU (driver? CUDA_VISIBLE_DEVICES?)"
    fi
    if grep -q "built without CUDA" "$TLOG"; then
        fail "the test binary was built without CUDA"
    fi
else
    fail "build/tests/kvcc_tests missing"
fi

step "the serving example on the GPU (examples/serve_skeleton.c) against the same run on the CPU"
# A small artifact compiled from a synthetic corpus (no model weights needed); each policy runs
# once on a CUDA context (device pointers throughout) and once with --cpu: the kept positions
# and the blocks read must be the same, the printed outputs the same to the printed digits; AM
# must run on the device (no fallback note) and keep as many entries per head as on the CPU.
if build 300 build/kvcc build/examples/serve_skeleton; then
    EX="$SCRATCH/example"
    mkdir -p "$EX"
    if bounded 60 build/kvcc synth --model smollm2-135m --prompts 1 --context 640 --continuation 32 \
           -o "$EX/c.h5" && bounded 90 build/kvcc compile --model smollm2-135m --corpus "$EX/c.h5" \
           --policies all --budgets 128 --am-targets 0.1 --kv2-budgets 0.2 --kv2-rho 0.2 \
           --kv2-max-passes 1 -o "$EX/p.kvpol"; then
        bounded 150 bash scripts/serve-compare.sh build/examples/serve_skeleton "$EX/p.kvpol" compilerkv compkv am kv2 merge-reduce
        rc=$?
        [ "$rc" -eq 0 ] ||
            fail "serve_skeleton: a policy's GPU run differs from its CPU run (serve-compare lines above; $(how "$rc"))"
        # AM with OMP key selection
        if bounded 60 build/kvcc compile --model smollm2-135m --corpus "$EX/c.h5" --policies am --am-select omp \
               --am-targets 0.1 -o "$EX/omp.kvpol"; then
            bounded 60 bash scripts/serve-compare.sh build/examples/serve_skeleton "$EX/omp.kvpol" am
            rc=$?
            [ "$rc" -eq 0 ] || fail "serve_skeleton: AM with OMP differs on the GPU from its CPU run ($(how "$rc"))"
        else
            fail "kvcc compile --am-select omp for the serving example"
        fi
    else
        fail "kvcc synth / compile for the serving example"
    fi
else
    fail "make USE_CUDA=1 build/kvcc build/examples/serve_skeleton"
fi

step "the Python binding on the GPU (python/tests/cuda_calls.py) against the CPU"
# Every binding call that takes ctx=, with device arrays on a CUDA context (AM both ways, one
# head, merge-reduce, the baselines' scores, KV2's plan, CompKV f32 and bf16, Quest): the CPU's
# results; host arrays refused. Random inputs at SmolLM2 shapes (96 tokens).
if ! python3 -c "import numpy" 2>/dev/null; then
    echo "not run: python3 with numpy is not installed on this machine"
elif [ ! -f build/libkvrt.so ]; then
    fail "python/tests/cuda_calls.py not run: build/libkvrt.so was not built"
else
    NPZ="$SCRATCH/calls.npz"
    python3 -c "import numpy as np, sys; r = np.random.default_rng(5)
f = lambda *s: r.standard_normal(s).astype(np.float32)
np.savez(sys.argv[1], q=f(96, 9, 64), k=f(96, 3, 64), v=f(96, 3, 64))" "$NPZ"
    for w in quest calls; do
        PYTHONUNBUFFERED=1 PYTHONPATH=python KVRT_LIBRARY="$PWD/build/libkvrt.so" bounded 150 \
            python3 python/tests/cuda_calls.py "$w" "$NPZ"
        rc=$?
        [ "$rc" -eq 0 ] || fail "python/tests/cuda_calls.py $w $(how "$rc")"
    done
fi

step "CUDA kernels under compute-sanitizer (memcheck, racecheck), when the toolkit has it"
# The attend kernels (runtime/cuda/attend.cu) were written on a machine without a GPU: check
# their memory accesses once here. Criterion forks a process per test, hence --target-processes.
# A sanitizer that refuses the GPU ("Device not supported": seen on gVisor machines) is noted,
# not reported as a finding of the kernels.
CSAN="$(command -v compute-sanitizer 2>/dev/null || true)"
[ -n "$CSAN" ] || { [ -x /usr/local/cuda/bin/compute-sanitizer ] && CSAN=/usr/local/cuda/bin/compute-sanitizer; }
# csan_verdict RC LOG WHAT: clean, unsupported (a note) or a failure
csan_verdict() {
    if [ "$1" -eq 0 ]; then
        echo "compute-sanitizer $3: clean"
    elif grep -q "Device not supported" "$2"; then
        echo "compute-sanitizer $3: not run, the sanitizer does not support this machine's GPU"
        return 1
    else
        tail -n 40 "$2"
        fail "compute-sanitizer $3 $(how "$1")"
    fi
    return 0
}
if [ "$EMU" = 1 ]; then
    echo "EMU=1: compute-sanitizer step skipped (it needs a GPU)"
elif [ -n "$CSAN" ] && [ -x build/tests/kvcc_tests ]; then
    CLOG="$OUTDIR/device-check.attend.memcheck.log"
    bounded 120 "$CSAN" --tool memcheck --target-processes all --error-exitcode 99 \
        build/tests/kvcc_tests --jobs 1 --filter 'cuda/attend*' > "$CLOG" 2>&1
    rc=$?
    # every CUDA entry point of the backend table (tests/backend), under memcheck and racecheck
    if csan_verdict "$rc" "$CLOG" "memcheck on the CUDA attend tests" && [ -x build/tests/test_backend_ops ]; then
        for tool in memcheck racecheck; do
            CLOG="$OUTDIR/device-check.backend-ops.$tool.log"
            bounded 120 "$CSAN" --tool $tool --error-exitcode 99 build/tests/test_backend_ops \
                > "$CLOG" 2>&1
            csan_verdict $? "$CLOG" "$tool on test_backend_ops"
        done
    fi
else
    echo "compute-sanitizer not found: step skipped"
fi

step "benchmarks with --cuda"
n_bench=0
# bench_run CMD...: one GPU benchmark, bounded (400 s emulated, 120 s on a GPU); a failure is
# recorded, the script goes on
bench_lim=120
[ "$EMU" = 1 ] && bench_lim=400
bench_run() {
    echo "-- $*"
    bounded "$bench_lim" "$@"
    local rc=$?
    [ "$rc" -eq 0 ] || fail "$* $(how "$rc")"
}
# bench_small NAME: EMU=1's smaller sizes for a benchmark, into small (the same code paths; the
# emulation runs kernels on one core)
bench_small() {
    small=()
    [ "$EMU" = 1 ] || return 0
    case "$1" in
    bench_attend) small=(--ctx 1024 --runs 1) ;;
    bench_am) small=(--layer-context 4096) ;;
    bench_compilerkv) small=(--context 1024 --reps 1) ;;
    bench_compkv) small=(--ctx 4096 --runs 1) ;;
    esac
}
for b in build/bench/*; do
    if [ ! -f "$b" ] || [ ! -x "$b" ]; then continue; fi
    src="bench/$(basename "$b").c"
    # A bench takes --cuda when its source names the flag; others are CPU-only and skipped here.
    if [ -f "$src" ] && grep -q -- '--cuda\|"cuda"' "$src"; then
        n_bench=$((n_bench + 1))
        bench_small "$(basename "$b")"
        bench_run "$b" --cuda "${small[@]}"
    fi
done
# AM's OMP key selection (rounds on the host, passes on the device) at a shorter context: its
# CPU side, timed in the same run, is O(n T t) per head
# (EMU=1 skips it: its Gram passes take ~8 minutes emulated on one core at the smallest context)
if [ "$EMU" = 1 ]; then
    echo "-- build/bench/bench_am --cuda --omp: not run under EMU=1 (8 minutes emulated)"
elif [ -x build/bench/bench_am ]; then
    bench_run build/bench/bench_am --cuda --omp --omp-batch 8 --layer-context 8192
fi
# AM with bf16 products (cublasGemmEx; kvrt_am_opts.products), the same layer as the f32 run
if [ -x build/bench/bench_am ]; then
    bench_small bench_am
    bench_run build/bench/bench_am --cuda --products bf16 "${small[@]}"
fi
echo "$n_bench benchmark(s) with --cuda run"

step "summary"
if [ "${#FAILED[@]}" -eq 0 ]; then
    echo "device-check: all steps passed (log: $LOG)"
    exit 0
fi
echo "device-check: ${#FAILED[@]} step(s) failed (log: $LOG):"
for f in "${FAILED[@]}"; do echo "  - $f"; done
exit 1
