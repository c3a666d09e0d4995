#!/usr/bin/env bash
# bench/ckv_stability.sh: how stable the CompilerKV head tables are against the calibration size.
#
# usage: bench/ckv_stability.sh [SIZE ...]     SIZE = PROMPTSxTOKENS, e.g. 8x512 16x2048
#        (default: 4x512 8x512, a quick curve)
# For each size it compiles CompilerKV with --transfer-check (4 compiles: A, B, B with seed + 1,
# A with seed + 1) and prints one table row per budget:
#   size, budget, A vs A(seed+1) Spearman of W_head (same corpus, other action draws),
#   A vs B(seed+1) Spearman (two disjoint corpora, other draws), the same two on the KV-group
#   maxima (what the selection sees), gate support of A's compile (of the reachable gate states),
#   seconds per compile (the command's wall / 4).
# Corpora (captured on first use, reused after): A = State of the Union addresses before 1950
# (examples/data/calib2/*.txt and the four addresses in examples/data/calib), B = Moby-Dick
# chapters 1-25 (examples/data/calib/moby-dick-ch001-025.txt); disjoint by source text.
# Environment: KVCC (default build/kvcc), GGUF (default models/SmolLM2-135M-Instruct.Q4_1.gguf),
# CKV_DIR (corpora and logs, default build/ckv_stability), CKV_BUDGETS (default 128,256),
# CKV_OPTS (extra kvcc compile options, e.g. "--head-states head --head-actions 4"),
# CKV_THREADS (default 1: timings comparable on a shared machine), CKV_CONT (continuation
# tokens, default 128).
set -euo pipefail
cd "$(dirname "$0")/.."
KVCC=${KVCC:-build/kvcc}
GGUF=${GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
DIR=${CKV_DIR:-build/ckv_stability}
BUDGETS=${CKV_BUDGETS:-128,256}
OPTS=${CKV_OPTS:-}
THREADS=${CKV_THREADS:-1}
CONT=${CKV_CONT:-128}
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(4x512 8x512)
[ -x "$KVCC" ] || { echo "ckv_stability: $KVCC not built (make)" >&2; exit 2; }
[ -f "$GGUF" ] || { echo "ckv_stability: $GGUF missing (scripts/fetch-model.sh)" >&2; exit 2; }
mkdir -p "$DIR"

A_TEXT=()
for f in examples/data/calib2/*.txt examples/data/calib/1*.txt; do A_TEXT+=(--text "$f"); done
B_TEXT=(--text examples/data/calib/moby-dick-ch001-025.txt)

# the largest prompt count per token length: one capture per (corpus, length)
declare -A MAXP
for s in "${SIZES[@]}"; do
    [[ $s =~ ^([0-9]+)x([0-9]+)$ ]] || { echo "ckv_stability: size '$s': expected PROMPTSxTOKENS" >&2; exit 2; }
    p=${BASH_REMATCH[1]} t=${BASH_REMATCH[2]}
    [ "${MAXP[$t]:-0}" -ge "$p" ] || MAXP[$t]=$p
done
corpus() { # corpus NAME TOKENS -> path (captured if missing or too small)
    local name=$1 t=$2 n=${MAXP[$2]} f="$DIR/$1-$2.h5"
    if [ -f "$f" ] && [ "$(cat "$f.prompts" 2>/dev/null || echo 0)" -ge "$n" ]; then echo "$f"; return; fi
    local -n txt=${name}_TEXT
    echo "ckv_stability: capturing $f ($n windows of $t + $CONT tokens)" >&2
    "$KVCC" capture --gguf "$GGUF" "${txt[@]}" --prompts "$n" --context "$t" --continuation "$CONT" \
        -o "$f" >&2
    echo "$n" > "$f.prompts"
    echo "$f"
}

ROWS=()
for s in "${SIZES[@]}"; do
    [[ $s =~ ^([0-9]+)x([0-9]+)$ ]]
    p=${BASH_REMATCH[1]} t=${BASH_REMATCH[2]}
    A=$(corpus A "$t") B=$(corpus B "$t")
    log="$DIR/compile-$s${CKV_TAG:+-$CKV_TAG}.log"
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$KVCC" compile --model smollm2-135m --policies compilerkv --corpus "$A" --prompts "$p" --budgets "$BUDGETS" \
        --threads "$THREADS" $OPTS --transfer-check "$B" -o "$DIR/ckv-$s${CKV_TAG:+-$CKV_TAG}.kvpol" > "$log.out" 2> "$log"
    t1=$(date +%s.%N)
    secs=$(echo "($t1 - $t0) / 4" | bc -l)
    gate=$(grep -o 'supported states [0-9]*/[0-9]* head, [0-9]*/[0-9]* gate' "$log" | head -1 |
           sed -E 's/.* ([0-9]+)\/([0-9]+) gate/\1 \2/')
    read -r gs gn <<< "$gate"
    # transfer-check rows: budget, A vs B, A vs B(seed+1), A vs A(seed+1), ... | group: the same
    # three after "KV-group max (N cells):". Cross-corpus = A vs B(seed+1): other corpus and other
    # action draws (A vs B at the same seed shares the draws, which correlates the tables by itself)
    while read -r line; do
        ROWS+=("$(awk -v s="$s" -v gs="$gs" -v gn="$gn" -v secs="$secs" '{
            split($0, h, "|"); split(h[1], a, " "); split(h[2], g, " ");
            printf "%-8s %6s %12s %10s %12s %10s %9.1f%% %9.1f\n", s, a[1], a[4], a[3], g[3], g[2],
                   100.0 * gs / gn, secs }' <<< "$line")")
    done < <(grep -E '^ +[0-9]+ +-?[0-9.]+ ' "$log.out")
    echo "ckv_stability: $s done ($(printf '%.0f' "$secs") s per compile; $log.out)" >&2
done
echo "CompilerKV head-table stability (kvcc compile --model smollm2-135m --policies compilerkv --budgets $BUDGETS --threads $THREADS $OPTS)"
echo "Spearman of W_head over (layer, query head); 'grp': over the KV-group maxima (what the selection reads)"
printf "%-8s %6s %12s %10s %12s %10s %10s %9s\n" size budget "A-A(seed+1)" "A-B(s+1)" "grp A-A'" "grp A-B'" "gate sup" "s/compile"
for r in "${ROWS[@]}"; do echo "$r"; done
