#!/usr/bin/env bash
# cpu_goals.sh - the CPU goals of docs/benchmarks.md ("The CPU goals in one run") measured back to
# back, each as a ratio taken inside its own benchmark run, then one summary table: measured ratio,
# goal, met or not. Not a test (timings); run by hand on a machine with nothing else running.
#
#   prefill, decode  bench/prefill_vs_torch.sh (ours vs transformers on torch CPU, same GGUF and
#                    token ids, equal threads; ours vs the GEMM / triad of the same run); the
#                    prefill again with --precision bf16 against transformers in bfloat16
#   prefill 8k       build/bench/bench_prefill --tokens 8192 (fraction of the GEMM rate)
#   CompilerKV       build/bench/bench_compilerkv --part 2 (window mass and the whole selection vs
#                    the window GEMM, llama3-8b shapes, 32k)
#   AM               bench/am_vs_scipy.sh (one head, T = 4096 and 16384, C vs numpy + scipy on the
#                    same algorithm, the defaults (judged) and the plain one (shown); the C
#                    compaction with f32 products and with bf16 products, kvrt_am_opts.products)
#   capture          kvcc capture's default job (16 x 2176 tokens) vs bench_prefill tokens/s on
#                    windows of the same length; a short run (576-token windows) beside it
#
# Usage: bench/cpu_goals.sh [--quick]   (--quick: fewer repetitions, about half the time)
# Env: KVCC_MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf), BUILD (default build).
# Needs the model (scripts/fetch-model.sh) and the peer packages (scripts/install-peer-deps.sh);
# prints "skipped" for a part whose inputs are missing.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
model="${KVCC_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
build="${BUILD:-build}"
reps=5 prompts=2
if [ "${1:-}" = "--quick" ]; then reps=3 prompts=1; fi
log="$(mktemp -d)"
trap 'rm -rf "$log"' EXIT
make --no-print-directory "$build/kvcc" "$build/bench/bench_prefill" "$build/bench/bench_compilerkv" \
    "$build/bench/bench_am" >/dev/null || { echo "cpu_goals: build failed" >&2; exit 1; }

rows=()
row() { rows+=("$(printf '| %s | %s | %s | %s |' "$1" "$2" "$3" "$4")"); }
judge() { # value goal op(ge|le) -> yes/no
    awk -v v="$1" -v g="$2" -v op="$3" 'BEGIN { if (v == "") { print "-"; exit }
        print ((op == "ge" && v + 0 >= g + 0) || (op == "le" && v + 0 <= g + 0)) ? "yes" : "no" }'
}
# capture_ratio TAG PREFILL_PROMPTS TOKENS CAPTURE_ARGS...: bench_prefill's tokens/s on windows
# of TOKENS tokens (pt), kvcc capture's with CAPTURE_ARGS (ct; its output in $log/TAG.txt, empty
# when it failed) and their ratio (c)
capture_ratio() {
    local tag=$1 pp=$2 tokens=$3
    shift 3
    "$build/bench/bench_prefill" --model "$model" --prompts "$pp" --tokens "$tokens" --reps "$reps" > "$log/p$tokens.txt"
    pt=$(sed -n 's/^RESULT tokens_per_s=\([0-9.]*\) .*/\1/p' "$log/p$tokens.txt")
    ct=$("$build/kvcc" capture --gguf "$model" "$@" -o "$log/$tag.h5" 2>&1 | tee "$log/$tag.txt" \
        | sed -n 's/.*(\([0-9.]*\) tokens\/s[;)].*/\1/p' | tail -1)
    rm -f "$log/$tag.h5"
    tail -1 "$log/$tag.txt"
    c=$(awk -v a="$ct" -v b="$pt" 'BEGIN { if (a != "" && b > 0) printf "%.2f", a / b }')
}
uptime_load() { awk '{print $1}' /proc/loadavg; }

echo "== cpu_goals: $(date -u +%FT%TZ), load $(uptime_load), $(nproc) cores"
"$build/kvcc" --version | sed 's/^/   /'

if [ -f "$model" ]; then
    echo "== prefill + decode vs torch, 512 tokens (bench/prefill_vs_torch.sh)"
    bench/prefill_vs_torch.sh --prompts "$prompts" --tokens 512 --reps "$reps" --decode 64 --no-skylakex \
        | tee "$log/pvt.txt" | grep -E '^(prefill|decode|triad|RATIO)'
    r=$(sed -n 's/^RATIO \[.*median: .* = \([0-9.]*\)x;.*/\1/p' "$log/pvt.txt" | head -1)
    row "prefill 512 tokens / torch f32 (median)" "${r:--}x" ">= 1.0x" "$(judge "$r" 1.0 ge)"
    f=$(sed -n 's/^RESULT tokens_per_s=.* fraction=\([0-9.]*\) .*/\1/p' "$log/pvt.txt" | head -1)
    row "prefill 512 tokens / GEMM rate" "${f:--}" ">= 0.60" "$(judge "$f" 0.60 ge)"
    r=$(sed -n 's/^RATIO-DECODE \[.*median: .* = \([0-9.]*\)x;.*/\1/p' "$log/pvt.txt" | head -1)
    row "decode / torch f32 (median)" "${r:--}x" ">= 1.0x" "$(judge "$r" 1.0 ge)"
    d=$(sed -n 's/^RESULT_DECODE tokens_per_s=\([0-9.]*\) .*ceiling=\([0-9.]*\) .*/\1 \2/p' "$log/pvt.txt" | head -1 \
        | awk '{ if ($2 > 0) printf "%.2f", $1 / $2 }')
    row "decode / weight-bandwidth limit (triad)" "${d:--}" ">= 0.70" "$(judge "$d" 0.70 ge)"

    echo "== bf16 prefill vs torch bf16, 512 tokens (bench/prefill_vs_torch.sh --precision bf16)"
    bench/prefill_vs_torch.sh --prompts "$prompts" --tokens 512 --reps "$reps" --no-skylakex --precision bf16 \
        | tee "$log/pvt_bf16.txt" | grep -E '^(prefill|RATIO)'
    r=$(sed -n 's/^RATIO \[.*median: .* = \([0-9.]*\)x;.*/\1/p' "$log/pvt_bf16.txt" | head -1)
    row "bf16 prefill 512 tokens / torch bf16 (median)" "${r:--}x" ">= 1.0x" "$(judge "$r" 1.0 ge)"

    echo "== prefill 8192 tokens (bench_prefill)"
    "$build/bench/bench_prefill" --model "$model" --prompts 1 --tokens 8192 --reps "$((reps > 3 ? 3 : reps))" \
        | tee "$log/p8k.txt" | grep -E '^prefill'
    f=$(sed -n 's/^RESULT tokens_per_s=.* fraction=\([0-9.]*\) .*/\1/p' "$log/p8k.txt" | head -1)
    row "prefill 8192 tokens / GEMM rate" "${f:--}" ">= 0.50" "$(judge "$f" 0.50 ge)"

    # capture's goal is measured on kvcc capture's default job (16 prompts of 2048 + 128 tokens:
    # what a user or a CI job runs), against bench_prefill on windows of the same length. The
    # short run (576-token windows, 2 x prompts) is reported beside it: there the process's
    # one-time costs (oneDNN primitives, first-touch pages, the final fsync: ~0.2 s) weigh on
    # 4 prompts of 0.7 s each.
    echo "== capture vs prefill, kvcc capture's default job (16 prompts of 2048 + 128 tokens)"
    cprompts=16
    if [ "$reps" -lt 5 ]; then cprompts=8; fi
    capture_ratio capd 2 2176 --prompts "$cprompts"
    echo "   bench_prefill 2176 tokens: ${pt:--} tokens/s"
    label="capture (with log-probabilities) / prefill, default job (16 x 2176 tokens)"
    [ "$cprompts" = 16 ] || label="capture (with log-probabilities) / prefill, $cprompts x 2176 tokens (--quick)"
    if [ -z "$ct" ]; then # the capture failed (about 2 GB go to $TMPDIR): a goal not shown is not met
        echo "   kvcc capture failed (TMPDIR=${TMPDIR:-/tmp}); its output:" && tail -3 "$log/capd.txt"
        row "$label" "capture failed" ">= 0.70" "no"
    else
        row "$label" "${c:--}" ">= 0.70" "$(judge "$c" 0.70 ge)"
    fi

    echo "== capture vs prefill, 576-token windows, $((prompts * 2)) prompts (one-time costs included)"
    capture_ratio cap "$prompts" 576 --prompts "$((prompts * 2))" --context 512 --continuation 64
    row "capture / prefill, $((prompts * 2)) x 576 tokens (short run)" "${c:--}" "-" "-"
else
    echo "== prefill, decode, capture: skipped (no model at $model; scripts/fetch-model.sh)"
fi

echo "== CompilerKV selection at llama3-8b shapes, 32k (bench_compilerkv --part 2)"
"$build/bench/bench_compilerkv" --part 2 --reps "$reps" | tee "$log/ckv.txt" | sed -n '/part 2/,$p'
w=$(awk '/window mass \(QK/ {print $NF}' "$log/ckv.txt" | head -1)
t=$(awk '/CompilerKV total/ {print $NF}' "$log/ckv.txt" | head -1)
row "CompilerKV window mass / window GEMM, 32k" "${w:--}x" "-" "-"
row "CompilerKV selection / window GEMM, 32k" "${t:--}x" "<= 1.25x" "$(judge "$t" 1.25 le)"

echo "== AM one-head compaction vs numpy + scipy (bench/am_vs_scipy.sh)"
REPS="$reps" bash bench/am_vs_scipy.sh | tee "$log/am.txt" | grep -E '^(default|plain) T '
# The issue's 10x, judged for f32 products and for bf16 products; bf16 only where the CPU has AMX.
# Both sides run the same algorithm: kvrt_am_opts' defaults (judged) and the plain algorithm
# (shown). f32's two products alone, at the f32 GEMM rate, take most of what 10x allows
# (docs/benchmarks.md, "Two runs on 2026-12-05, late night, and the Attention Matching goal";
# "The numpy side ran another problem" for the two comparisons)
amx=no
grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null && amx=yes
for mode in default plain; do
    for T in 4096 16384; do
        a=$(sed -n "s/^$mode T $T wall: .*(detected kernels: \([0-9.]*\)x faster).*/\1/p" "$log/am.txt" | head -1)
        b=$(sed -n "s/^$mode T $T wall: .*(products bf16: \([0-9.]*\)x faster).*/\1/p" "$log/am.txt" | head -1)
        if [ "$mode" = default ]; then
            f=$(sed -n "s/^$mode T $T f32 bound: .* more than \([0-9.]*\)x faster.*/\1/p" "$log/am.txt" | head -1)
            row "AM compaction T=$T / numpy+scipy (wall), f32 products (bound: the f32 products alone ${f:--}x)" "${a:--}x" ">= 10x" "$(judge "$a" 10 ge)"
            bgoal="- (no AMX)" bmet="-"
            if [ "$amx" = yes ]; then bgoal=">= 10x (AMX)" bmet=$(judge "$b" 10 ge); fi
            row "AM compaction T=$T, --am-products bf16 / numpy+scipy (wall)" "${b:--}x" "$bgoal" "$bmet"
        else
            row "AM compaction T=$T, plain algorithm, f32 / bf16 products (wall)" "${a:--}x / ${b:--}x" "-" "-"
        fi
    done
done

echo
echo "== summary (load at the end: $(uptime_load))"
echo "| measurement | measured | goal | met |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
