#!/usr/bin/env bash
# install-deps.sh: install the Debian packages kvcc needs to build and test.
# Called by `make demo`, `make test` and .ci/run. Idempotent: quiet when
# everything is present. As non-root it prints the exact command to run.
set -euo pipefail

PKGS=(build-essential pkg-config libhdf5-dev hdf5-tools libzstd-dev libxxhash-dev
      libopenblas-dev liblapacke-dev libcriterion-dev libcjson-dev clang
      libopenmpi-dev openmpi-bin libdnnl-dev)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "kvcc: missing Debian packages: ${missing[*]}" >&2
  echo "kvcc: run as root:  apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 1
fi

echo "kvcc: installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "kvcc: dependencies installed"
