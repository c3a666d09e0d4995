#!/usr/bin/env bash
# install.sh: `make install` as a user runs it, and a consumer that knows only pkg-config.
# Installs into a scratch PREFIX (and once more through DESTDIR), checks the tree (headers, static
# and shared libraries with their soname links, kvrt.pc/kvpol.pc, kvcc), builds
# examples/serve_skeleton.c OUT OF TREE (a copy in a scratch directory, no -I/-L into this
# checkout) with `pkg-config --cflags --libs kvrt` only, shared and static, runs both on an
# artifact compiled by the INSTALLED kvcc, and checks that `make uninstall` leaves nothing behind.
# Called by `make test` (make check-install). Prints `install: N passed, M failed`.
# Env: KVCC_BUILD (default build), MAKE (default make), SANFLAGS (the SAN=1 build's flags: an
# ASan-built libkvrt needs them on the consumer's link line too).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
build=${KVCC_BUILD:-build}
make_cmd=${MAKE:-make}
san=${SANFLAGS:-}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvcc-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
pass=0; fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "install: FAIL: $*" >&2; }

sanarg=""; [ -n "$san" ] && sanarg="SAN=1"
bd=""; [ "$build" != build ] && [ "$build" != build/san ] && bd="BUILDDIR=$build"
prefix="$tmp/prefix"
ver=$(sed -n 's/^#define KVRT_VERSION_STRING "\(.*\)"/\1/p' runtime/include/kvrt.h)
abi=${ver%.*}

# 1. make install PREFIX=...
if out=$($make_cmd --no-print-directory install $sanarg $bd PREFIX="$prefix" 2>&1); then ok
else bad "make install PREFIX=$prefix failed: $(echo "$out" | tail -5)"; echo "install: $pass passed, $fail failed"; exit 1; fi
for f in bin/kvcc include/kvrt.h include/kvrt_experimental.h include/kvrt_rng.h include/kvpol.h \
         include/kvpol_sections.h lib/libkvrt.a lib/libkvpol.a lib/libkvrt.so.$ver \
         lib/libkvpol.so.$ver lib/pkgconfig/kvrt.pc lib/pkgconfig/kvpol.pc; do
  [ -f "$prefix/$f" ] && ok || bad "make install did not install $f"
done
for l in kvrt kvpol; do
  [ "$(readlink "$prefix/lib/lib$l.so")" = "lib$l.so.$abi" ] && \
    [ "$(readlink "$prefix/lib/lib$l.so.$abi")" = "lib$l.so.$ver" ] && ok || bad "lib$l.so links"
  so=$(objdump -p "$prefix/lib/lib$l.so.$ver" 2>/dev/null | awk '/SONAME/ {print $2}')
  [ "$so" = "lib$l.so.$abi" ] && ok || bad "lib$l.so.$ver has soname '$so', expected lib$l.so.$abi"
done

# 1b. a CUDA build installs its backend beside libkvrt, and the installed kvcc (libkvrt.a, in
#     PREFIX/bin) finds it in ../lib (LIBDIR relative to BINDIR; 9. below for lib64); nothing installed links a CUDA library itself
if [ -e "$build/libkvrt_cuda.so" ]; then
  [ -f "$prefix/lib/libkvrt_cuda.so.$ver" ] && \
    [ "$(readlink "$prefix/lib/libkvrt_cuda.so.$abi")" = "libkvrt_cuda.so.$ver" ] && ok \
    || bad "make install did not install lib/libkvrt_cuda.so.$ver with its soname link"
  out=$("$prefix/bin/kvcc" --version | grep '^CUDA:')
  [[ "$out" == *"$prefix/bin/../lib/libkvrt_cuda.so.$abi"* ]] && ok || bad "installed kvcc --version: $out"
fi
for f in "$prefix/bin/kvcc" "$prefix/lib/libkvrt.so.$ver"; do
  ! ldd "$f" 2>/dev/null | grep -Eq 'libcudart|libcublas|libcusolver' && ok || bad "$f links a CUDA library"
done

# 1c. the shared libraries export their API only: every defined symbol is named in an installed
#     header (OpenMP's critical-section locks and reserved _names of the toolchain aside, e.g.
#     ASan's), so nothing internal becomes ABI or clashes
for l in kvrt kvpol; do
  stray=$(nm -D --defined-only "$prefix/lib/lib$l.so.$ver" | awk '{print $3}' | grep -v '^\.gomp_critical\|^_' |
          while read -r s; do grep -qw -- "$s" "$prefix"/include/*.h || echo "$s"; done)
  [ -z "$stray" ] && ok || bad "lib$l.so exports symbols no installed header names: $stray"
done

# 2. pkg-config sees the installed copy
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
[ "$(pkg-config --modversion kvrt)" = "$ver" ] && [ "$(pkg-config --modversion kvpol)" = "$ver" ] \
  && ok || bad "pkg-config --modversion kvrt/kvpol: expected $ver"
# relocatable: libdir and includedir relative to ${prefix}, so --define-prefix follows a copy
mkdir -p "$tmp/moved/lib" && cp -r "$prefix/lib/pkgconfig" "$tmp/moved/lib/" && \
  [ "$(PKG_CONFIG_PATH="$tmp/moved/lib/pkgconfig" pkg-config --define-prefix --cflags kvrt | xargs)" = "-I$tmp/moved/include" ] \
  && ok || bad "kvrt.pc is not relocatable: $(grep dir= "$prefix/lib/pkgconfig/kvrt.pc" | tr '\n' ' ')"
cflags=$(pkg-config --cflags kvrt); libs=$(pkg-config --libs kvrt)
[[ "$cflags $libs" != *"$root"* ]] && ok || bad "kvrt.pc points into the source tree: $cflags $libs"

# 3. an artifact made by the installed kvcc
kv="$prefix/bin/kvcc"
"$kv" synth --model smollm2-135m --prompts 1 --context 128 --continuation 32 -o "$tmp/cs.h5" 2>/dev/null && \
"$kv" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am,compilerkv,compkv --budgets 32,64 \
  --am-targets 0.1,0.2 --cql-steps 500 -o "$tmp/p.kvpol" 2>/dev/null && ok || bad "the installed kvcc could not synth + compile"

# 3b. the installed kvcc finds its bundled texts and the fetched model in PREFIX/share/kvcc from
#     any directory: a capture with the defaults, run outside the checkout, gives the bytes of the
#     same capture run in the checkout
ls "$prefix"/share/kvcc/examples/data/calib/*.txt "$prefix"/share/kvcc/examples/data/heldout/*.txt \
  >/dev/null 2>&1 && ok || bad "make install did not install the bundled texts into share/kvcc"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$model" ]; then
  [ -f "$prefix/share/kvcc/$model" ] && ok || bad "make install did not install the fetched $model"
  cap="--prompts 1 --context 48 --continuation 8"
  if (cd "$tmp" && "$kv" capture $cap -o "$tmp/cap-installed.h5" >/dev/null 2>"$tmp/cap.err") && \
     "$build/kvcc" capture $cap -o "$tmp/cap-tree.h5" >/dev/null 2>&1; then
    cmp -s "$tmp/cap-installed.h5" "$tmp/cap-tree.h5" && ok || bad "the installed kvcc's default capture differs from the tree's"
  else bad "the installed kvcc capture with its defaults, run in $tmp: $(tail -3 "$tmp/cap.err")"; fi
fi

# 4. serve_skeleton.c built out of tree with pkg-config only: shared, then static
mkdir -p "$tmp/src"; cp examples/serve_skeleton.c "$tmp/src/"
( cd "$tmp/src" && cc -std=c11 -O2 $san serve_skeleton.c $(pkg-config --cflags --libs kvrt) -lm \
    -o serve_shared ) 2>"$tmp/cc1.err" && ok || bad "shared out-of-tree build: $(cat "$tmp/cc1.err")"
( cd "$tmp/src" && cc -std=c11 -O2 $san serve_skeleton.c $(pkg-config --cflags kvrt) \
    -Wl,-Bstatic -lkvrt -lkvpol -Wl,-Bdynamic \
    $(pkg-config --static --libs kvrt | sed 's/ -lkvrt / /; s/ -lkvpol / /') -o serve_static ) \
    2>"$tmp/cc2.err" && ok || bad "static out-of-tree build: $(cat "$tmp/cc2.err")"
if [ -x "$tmp/src/serve_shared" ]; then
  # The shared build resolves libkvrt from the prefix (not the build tree).
  ldd_out=$(LD_LIBRARY_PATH="$prefix/lib" ldd "$tmp/src/serve_shared")
  [[ "$ldd_out" == *"$prefix/lib/libkvrt.so.$abi"* ]] && ok || bad "serve_shared does not load the installed libkvrt.so.$abi: $ldd_out"
  for p in compilerkv am compkv; do
    out=$(LD_LIBRARY_PATH="$prefix/lib" "$tmp/src/serve_shared" "$tmp/p.kvpol" --cpu --policy $p 2>&1); ex=$?
    [[ $ex -eq 0 && "$out" == *"$p: layer 15"* ]] && ok || bad "serve_shared --policy $p: exit $ex: $out"
  done
fi
if [ -x "$tmp/src/serve_static" ]; then
  ! ldd "$tmp/src/serve_static" | grep -q libkvrt && ok || bad "serve_static links libkvrt.so"
  out=$("$tmp/src/serve_static" "$tmp/p.kvpol" --cpu --policy am 2>&1); ex=$?
  [[ $ex -eq 0 && "$out" == *"am: layer 15"* ]] && ok || bad "serve_static --policy am: exit $ex: $out"
fi

# 5. make uninstall leaves only the empty directories
$make_cmd --no-print-directory uninstall $sanarg $bd PREFIX="$prefix" >/dev/null 2>&1 && ok || bad "make uninstall failed"
left=$(find "$prefix" -not -type d)
[ -z "$left" ] && ok || bad "make uninstall left: $left"

# 6. DESTDIR staging (what a distribution package does): files land under DESTDIR, and the .pc
#    names the final PREFIX
$make_cmd --no-print-directory install $sanarg $bd DESTDIR="$tmp/stage" PREFIX=/opt/kvcc >/dev/null 2>&1 && \
  [ -f "$tmp/stage/opt/kvcc/lib/libkvrt.so.$ver" ] && \
  grep -qx 'prefix=/opt/kvcc' "$tmp/stage/opt/kvcc/lib/pkgconfig/kvrt.pc" && ok || bad "make install DESTDIR=... PREFIX=/opt/kvcc"

# 7. a path with a space (make's word lists would split it): refused before anything is written
out=$($make_cmd --no-print-directory install $sanarg $bd PREFIX="$tmp/a b" 2>&1); ex=$?
[ $ex -ne 0 ] && echo "$out" | grep -q "the path '$tmp/a b' has a space" && [ ! -e "$tmp/a b" ] && [ ! -e "$tmp/a" ] \
  && ok || bad "make install PREFIX with a space: exit $ex: $out"

# 8. a relative PREFIX (it is written into kvrt.pc and read at run time): refused, nothing written
out=$(cd "$tmp" && $make_cmd --no-print-directory -C "$root" install $sanarg $bd PREFIX=rel/p 2>&1); ex=$?
[ $ex -ne 0 ] && echo "$out" | grep -q "the path 'rel/p' is relative" && [ ! -e "$root/rel" ] && [ ! -e "$tmp/rel" ] \
  && ok || bad "make install PREFIX=rel/p: exit $ex: $out"

# 9. LIBDIR outside PREFIX/lib (lib64 layouts), built for it first: the installed kvcc finds its
#    CUDA backend there. make install never rebuilds for other settings than the build's: it
#    refuses (as root it would leave root-owned objects in the build tree)
if [ -e "$build/libkvrt_cuda.so" ]; then
  p64="$tmp/p64"
  out=$($make_cmd --no-print-directory install $sanarg $bd PREFIX="$p64" LIBDIR="$p64/lib64" 2>&1); ex=$?
  [[ $ex -ne 0 && "$out" == *"run make with the same USE_CUDA, BINDIR and LIBDIR first"* && ! -e "$p64" ]] \
    && ok || bad "make install for another LIBDIR than the build's: exit $ex: $out"
  if $make_cmd --no-print-directory all $sanarg $bd PREFIX="$p64" LIBDIR="$p64/lib64" >/dev/null 2>&1 &&
     $make_cmd --no-print-directory install $sanarg $bd PREFIX="$p64" LIBDIR="$p64/lib64" >/dev/null 2>&1; then
    out=$("$p64/bin/kvcc" --version | grep '^CUDA:')
    [[ "$out" == *"$p64/bin/../lib64/libkvrt_cuda.so.$abi"* ]] && ok || bad "kvcc installed with LIBDIR=lib64, --version: $out"
    grep -qx 'libdir=${prefix}/lib64' "$p64/lib64/pkgconfig/kvrt.pc" && ok || bad "LIBDIR=lib64: kvrt.pc libdir"
  else bad "make + make install LIBDIR=$p64/lib64 failed"; fi
  $make_cmd --no-print-directory all $sanarg $bd >/dev/null 2>&1 || bad "make (back to the default LIBDIR) failed"
fi

echo "install: $pass passed, $fail failed"
[ $fail -eq 0 ]
