#!/usr/bin/env bash
# device-bundle.sh: build, on this machine, everything scripts/device-check.sh runs, and pack it
# with the shared libraries it needs into build/device/bundle.tar.xz, for a GPU machine that
# cannot build it: the lent GPU machines are described as having nvcc, CUDA's libraries and
# Python, with no package registry, and not the C libraries this project links (HDF5,
# OpenBLAS/LAPACKE, oneDNN, Criterion, cJSON, xxHash, zstd, Open MPI; unverified: docs/cuda.md).
#
#   bash scripts/device-bundle.sh          (from the repository root; needs nvcc here, USE_CUDA=1)
#   then, on the GPU machine, with build/device carried along:
#   bash scripts/device-check.sh           (it finds build/device/bundle.tar.xz and unpacks it
#                                           instead of building; docs/cuda.md "On a lent GPU")
#
# What goes in: the binaries and libraries device-check.sh runs (build/tests/kvcc_tests,
# build/tests/test_backend_ops, build/kvcc, build/examples/serve_skeleton, build/libkvrt.so, libkvpol.so,
# build/libkvrt_cuda.so, every build/bench/*, and with EMU=1 the emulated CUDA plugin for a
# rehearsal), plus every shared library they load except glibc's own, libstdc++/libgcc_s (the
# GPU machine's are newer, and CUDA's libraries need theirs) and CUDA's (libcudart, cuBLAS,
# cuSOLVER and what they load: the GPU machine's toolkit, found through /usr/local/cuda/lib64 or
# the Python wheels' nvidia/*/lib). The machine there must be x86-64 with glibc >= this one's.
# Size: about 30 MB (the device tool carries at most 64 MiB with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
DEST=build/device
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] ||
    { echo "device-bundle: nvcc not found: the bundle needs the CUDA plugin built here (USE_CUDA=1)" >&2; exit 1; }

BENCH=()
for src in bench/*.c; do BENCH+=("build/bench/$(basename "$src" .c)"); done
BINS=(build/tests/kvcc_tests build/tests/test_backend_ops build/kvcc build/examples/serve_skeleton "${BENCH[@]}")
LIBS=(build/libkvrt.so build/libkvrt_cuda.so build/libkvpol.so) # libkvpol.so: a cuda/* test loads it as a wrong plugin
[ "${EMU:-0}" = 1 ] && LIBS+=(build/cuda_emu/libkvrt_cuda_emu.so)
echo "device-bundle: make USE_CUDA=1 (${#BINS[@]} programs, ${#LIBS[@]} libraries)"
make -j"$JOBS" USE_CUDA=1 "${BINS[@]}" "${LIBS[@]}"

rm -rf "$DEST"
mkdir -p "$DEST/lib"
# every shared library the programs load, by the name the loader asks for (ldd's left column)
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libutil\.so|libresolv\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libcudart\.so|libcublas|libcublasLt|libcusolver|libcusparse|libnvJitLink|libnvrtc|libkvrt)'
missing=0
while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    if [ "$path" = "not" ] || [ ! -e "$path" ]; then
        echo "device-bundle: $name: not found on this machine" >&2
        missing=1
        continue
    fi
    case "$path" in /usr/local/cuda/*) continue ;; esac
    [ -e "$DEST/lib/$name" ] || cp -L "$path" "$DEST/lib/$name"
done < <(for f in "${BINS[@]}" "${LIBS[@]}"; do ldd "$f"; done |
         awk '$2 == "=>" { print $1, $3 }' | sort -u)
[ "$missing" = 0 ] || exit 1
# Open MPI opens its components at MPI_Init from its own folder: not bundled (kvcc's distributed
# compile is not part of the device check; the library itself loads without them)

# the archive unpacks at the repository root: build/... as here, libraries in build/device/lib
files=("${BINS[@]}" "${LIBS[@]}")
for l in build/libkvrt.so build/libkvrt_cuda.so build/libkvpol.so; do
    for s in "$l".*; do [ -L "$s" ] && files+=("$s"); done
done
tar -cf - "${files[@]}" "$DEST/lib" | xz -T"$JOBS" -6 > "$DEST/bundle.tar.xz.tmp"
mv "$DEST/bundle.tar.xz.tmp" "$DEST/bundle.tar.xz"
rm -rf "$DEST/lib"
sha256sum "$DEST/bundle.tar.xz" | awk '{print $1}' > "$DEST/bundle.sha256"
git rev-parse HEAD > "$DEST/bundle.commit" 2>/dev/null || true
echo "device-bundle: wrote $DEST/bundle.tar.xz ($(du -m "$DEST/bundle.tar.xz" | cut -f1) MB; $(tar -tJf "$DEST/bundle.tar.xz" | wc -l) files; commit $(cat "$DEST/bundle.commit" 2>/dev/null))"
echo "device-bundle: carry build/device to the GPU machine and run bash scripts/device-check.sh there"
