#!/usr/bin/env bash
# serve-compare.sh SKELETON ARTIFACT POLICY...: runs examples/serve_skeleton's POLICY calls on
# the CUDA backend (its default when a CUDA device is usable) and again with --cpu, and requires
# the same results: CompilerKV's kept positions and CompKV's blocks read exactly, the printed
# outputs within 2e-4 (the backends round differently in the last bits; %.4f shows the 4th
# decimal); AM run on the device (no "CPU context instead" note) with the same entry counts per
# KV head; KV2 the same entry counts and cache bytes (its scores are device products). Prints both runs and one "serve-compare: POLICY OK|FAILED: why" line per policy; exit
# 1 when one failed.
# Callers: scripts/device-check.sh (a GPU), tests/cli/run.sh (the CUDA emulation of
# tests/cuda_emu, through KVRT_CUDA_LIBRARY).
set -u -o pipefail
[ $# -ge 3 ] || { echo "usage: $0 SKELETON ARTIFACT POLICY..." >&2; exit 2; }
sk=$1 art=$2
shift 2
bad=0
sel() { grep -oE "(keeps positions|reads blocks)[^;]*" <<<"$1"; }
nums() { grep -oE "out\[0\]\[0\.\.3\]( -?[0-9.]+)+" <<<"$1" | sed 's/^out\[0\]\[0\.\.3\]//'; }
near() { awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, " "); m = split(b, y, " ");
         if (n != m || n == 0) exit 1
         for (i = 1; i <= n; i++) { e = x[i] - y[i]; if (e < 0) e = -e; if (e > 2e-4) exit 1 }
         exit 0 }'; }
amk() { grep -E "am: KV head" <<<"$1" | sed 's/, mass error.*//'; }
kvk() { grep -E "kv2: layer" <<<"$1"; }
for p in "$@"; do
    g=$("$sk" "$art" --policy "$p" 2>&1); gx=$?
    c=$("$sk" "$art" --policy "$p" --cpu 2>&1); cx=$?
    echo "-- $p on CUDA (exit $gx):"; echo "$g"
    echo "-- $p on the CPU (exit $cx):"; echo "$c"
    why=""
    if [ $gx -ne 0 ] || [ $cx -ne 0 ]; then
        why="exit $gx (CUDA) / $cx (CPU)"
    elif ! grep -q "device: CUDA" <<<"$g"; then
        why="the first run did not use a CUDA context"
    else
        case $p in
        am) if grep -q "CPU context instead" <<<"$g" || [ -z "$(amk "$g")" ] ||
               [ "$(amk "$g")" != "$(amk "$c")" ]; then
                why="not run on CUDA, or other entry counts than the CPU's"
            fi ;;
        kv2) # stage 2's attention scores are products on the device, not the CPU's bits: a
             # near tie may keep another position, so the entry counts and sizes must agree
             if [ -z "$(kvk "$g")" ] || [ "$(kvk "$g")" != "$(kvk "$c")" ]; then
                 why="other entry counts or cache bytes than the CPU's"
             fi ;;
        *) if [ -z "$(sel "$g")" ] || [ "$(sel "$g")" != "$(sel "$c")" ]; then
               why="the selection differs from the CPU's"
           elif ! near "$(nums "$g")" "$(nums "$c")"; then
               why="the outputs differ from the CPU's by more than 2e-4"
           fi ;;
        esac
    fi
    if [ -z "$why" ]; then echo "serve-compare: $p OK"; else echo "serve-compare: $p FAILED: $why"; bad=1; fi
done
exit $bad
