#!/bin/bash
# am_vs_scipy.sh: time the C Attention Matching compaction of one head (bench_am) against the same
# algorithm in numpy + scipy (bench/am_scipy.py) on the same inputs, T = 4096 and 16384, d = 128,
# ratio 0.05, 4096 reference queries; prints both times (medians of REPS = 5 runs each) and their
# ratio. Not a test.
# The C side runs twice: with the kernels the system OpenBLAS picks for this CPU, and with
# OPENBLAS_CORETYPE=Haswell, the kernels numpy's bundled OpenBLAS (scipy-openblas, newer) picks on
# the same machine: an old system OpenBLAS may not recognize a recent CPU and fall back to its
# generic Prescott kernels (seen on the dev VM: 3x slower products), which is not the algorithm's
# doing. The tests never set OPENBLAS_CORETYPE.
# A third C run has --products bf16 (kvrt_am_opts.products: the two large products in bf16 with
# f32 accumulation; numpy's stay f32): its mass and output errors are printed beside the f32 run's.
# Two comparisons per T, each the same algorithm on both sides (bench_am writes its options into
# meta.txt and am_scipy.py follows them; the mass and output errors printed by both agree to
# about three digits):
#   default  kvrt_am_opts' defaults: 4 exact sinks, an exact recent window of half the budget,
#            the middle compacted, beta floored at -3 (what kvcc and libkvrt run)
#   plain    bench_am --plain: every key compacted, keys of NNLS weight 0 dropped (the paper's
#            plain algorithm; a larger NNLS per chunk)
# The first C run also times its two f32 products alone (bench_am --floor, the kernel the
# compaction runs them on): numpy + scipy's time over that is the most any f32 compaction could
# gain on this machine ("f32 bound").
# Before 2026-12-06 the numpy side ran the plain algorithm against the C defaults, so the two
# sides did not solve the same problem (docs/benchmarks.md, "The numpy side ran another problem").
# Usage: [THREADS=1] [REPS=5] [MODES="default plain"] [BENCH_AM=a bench_am binary]
#        bash bench/am_vs_scipy.sh   (from the repository root; BUILD=build by default)
set -euo pipefail
BUILD=${BUILD:-build}
if [ -z "${BENCH_AM:-}" ]; then
  make --no-print-directory "$BUILD/bench/bench_am" >/dev/null
  BENCH_AM=$BUILD/bench/bench_am
fi
python3 -c 'import numpy, scipy' 2>/dev/null || pip install numpy scipy
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# THREADS=1 runs both sides on one thread (OPENBLAS_NUM_THREADS=OMP_NUM_THREADS=1) and compares
# their CPU seconds as well: on a loaded machine the steadier figure. Default: the BLAS defaults.
if [ -n "${THREADS:-}" ]; then
  export OPENBLAS_NUM_THREADS=$THREADS OMP_NUM_THREADS=$THREADS
fi
for mode in ${MODES:-default plain}; do
case "$mode" in
  default) flag=() ;;
  plain) flag=(--plain) ;;
  *) echo "am_vs_scipy.sh: MODES: $mode, expected default or plain" >&2; exit 2 ;;
esac
echo "== $mode"
for T in 4096 16384; do
  reps=${REPS:-5}
  c=$("$BENCH_AM" --head "$T" --reps "$reps" --dump "$dir" --floor ${flag[@]+"${flag[@]}"})
  echo "C (system OpenBLAS, $(OPENBLAS_VERBOSE=2 "$BENCH_AM" --head 16 --reps 1 2>&1 | awk '/^Core/ {print $2}') kernels): $(echo "$c" | grep -v '^c_')"
  ch=$(OPENBLAS_CORETYPE=Haswell "$BENCH_AM" --head "$T" --reps "$reps" ${flag[@]+"${flag[@]}"})
  echo "C (system OpenBLAS, Haswell kernels): $(echo "$ch" | grep -v '^c_')"
  cb=$("$BENCH_AM" --head "$T" --reps "$reps" --products bf16 ${flag[@]+"${flag[@]}"})
  echo "C (products bf16): $(echo "$cb" | grep -v '^c_')"
  echo "reps $reps" >> "$dir/meta.txt"
  p=$(python3 bench/am_scipy.py "$dir")
  echo "$p" | grep -v '^py_'
  cs=$(echo "$c" | awk '/^c_seconds/ {print $2}')
  chs=$(echo "$ch" | awk '/^c_seconds/ {print $2}')
  cbs=$(echo "$cb" | awk '/^c_seconds/ {print $2}')
  ps=$(echo "$p" | awk '/^py_seconds/ {print $2}')
  fs=$(echo "$c" | awk '/^c_f32_products_seconds/ {print $2}')
  cc=$(echo "$c" | awk '/^c_cpu_seconds/ {print $2}')
  chc=$(echo "$ch" | awk '/^c_cpu_seconds/ {print $2}')
  cbc=$(echo "$cb" | awk '/^c_cpu_seconds/ {print $2}')
  pc=$(echo "$p" | awk '/^py_cpu_seconds/ {print $2}')
  awk -v m="$mode" -v c="$cs" -v h="$chs" -v b="$cbs" -v p="$ps" -v T="$T" 'BEGIN { printf "%s T %d wall: numpy+scipy %.3f s; C %.3f s (detected kernels: %.1fx faster), %.3f s (Haswell kernels, as numpy: %.1fx faster), %.3f s (products bf16: %.1fx faster)\n", m, T, p, c, p / c, h, p / h, b, p / b }'
  awk -v m="$mode" -v f="$fs" -v p="$ps" -v T="$T" 'BEGIN { printf "%s T %d f32 bound: the two f32 products alone %.3f s: no f32 compaction here can be more than %.1fx faster than numpy+scipy\n", m, T, f, p / f }'
  awk -v m="$mode" -v c="$cc" -v h="$chc" -v b="$cbc" -v p="$pc" -v T="$T" 'BEGIN { printf "%s T %d CPU:  numpy+scipy %.3f s; C %.3f s (detected kernels: %.1fx less), %.3f s (Haswell kernels: %.1fx less), %.3f s (products bf16: %.1fx less)\n", m, T, p, c, p / c, h, p / h, b, p / b }'
done
done
