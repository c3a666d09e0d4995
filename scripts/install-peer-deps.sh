#!/usr/bin/env bash
# install-peer-deps.sh: install the PyPI packages of the peer checks (tests/peer/run.sh: the
# built-in model against transformers, examples/capture_hf.py against kvcc capture): torch,
# transformers, gguf, accelerate, h5py, numpy, scipy (python/tests/test_am_scipy.py: the AM
# compaction against bench/am_scipy.py), pytest (the Python package's tests, python/tests) and
# kvpress (python/tests/test_kvpress.py).
# Called by `make test` (so a fresh machine runs the peer checks instead of skipping them) and
# by tests/peer/run.sh --install. Idempotent: quiet when everything imports. KVCC_NO_PEER_INSTALL=1 skips the install (the checks then say "skipped").
set -euo pipefail

PY=${PYTHON:-python3}
MODS="torch transformers gguf accelerate h5py numpy scipy pytest"
# kvpress (python/tests/test_kvpress.py: the baselines against NVIDIA's presses) goes in without
# its dependencies: it pins transformers < 5.3 and pulls in datasets, peft and pandas for presses
# the test does not load; its press modules need only torch and transformers
KVPRESS="kvpress==0.5.5"
have_kvpress() { $PY -c "import importlib.util as u; exit(u.find_spec('kvpress') is None)" >/dev/null 2>&1; }
install_kvpress() {
  have_kvpress && return 0
  echo "kvcc: installing $KVPRESS with pip (--no-deps; python/tests/test_kvpress.py)"
  # one try with short timeouts: offline, a make test pays seconds for it, not pip's retries
  $PY -m pip install --quiet --disable-pip-version-check --no-deps --retries 0 --timeout 20 "$KVPRESS" ||
    echo "kvcc: WARNING: pip could not install $KVPRESS; test_kvpress will say 'skipped'" >&2
}
if $PY -c "import ${MODS// /, }" >/dev/null 2>&1; then
  [ "${KVCC_NO_PEER_INSTALL:-0}" = 1 ] || install_kvpress
  exit 0
fi
if [ "${KVCC_NO_PEER_INSTALL:-0}" = 1 ]; then
  echo "kvcc: peer-check packages missing and KVCC_NO_PEER_INSTALL=1: the peer checks will be skipped" >&2
  exit 0
fi
echo "kvcc: installing the peer checks' Python packages with pip ($MODS; torch is ~0.5 GB plus its CUDA libraries)"
t0=$(date +%s)
if ! $PY -m pip install --quiet --disable-pip-version-check $MODS; then
  echo "kvcc: WARNING: pip could not install $MODS; the peer checks will say 'skipped'" >&2
  exit 0
fi
install_kvpress
echo "kvcc: peer-check packages installed ($(( $(date +%s) - t0 )) s)"
