#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: the Python packages, then the control-plane binaries
# (built from the Go module proxy once, then cached under ${TESSERA_CACHE:-~/.cache/tessera}).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The checkout's operator/ folder would shadow the standard library's operator module when
# `python -m` puts the working directory on sys.path (seen in a fresh venv); tessera comes
# from the editable install instead.
export PYTHONSAFEPATH=1
PIP=("$PYTHON" -m pip install --disable-pip-version-check --quiet)
# `setup.sh demo` sets up what `make demo` runs; `setup.sh` (or `setup.sh test`) adds what only
# the tests need: the Debian libraries of the transfer engine, promtool, the loopback stores.
MODE=${1:-test}
if [[ $MODE != test && $MODE != demo ]]; then
  echo "usage: setup.sh [test|demo]" >&2
  exit 2
fi

# The Mooncake transfer engine's TCP transport (the PD handover tests) needs these two libraries
# to import, even without RDMA hardware.
if [[ $MODE == test ]] && command -v apt-get >/dev/null \
    && ! dpkg -s libibverbs1 librdmacm1 >/dev/null 2>&1; then
  echo "== debian packages: libibverbs1 librdmacm1"
  apt-get install -y -q libibverbs1 librdmacm1 >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 librdmacm1 >/dev/null; }
fi

echo "== python packages: pip install -e '.[test]'"
"${PIP[@]}" -e '.[test]'
# SGLang goes in without its GPU-only dependencies; on later runs pip's resolver lists those as
# "not installed" conflicts after the line above. That is expected and harmless here.
if [[ -f scripts/sglang-no-deps.txt ]]; then
  echo "== python packages: SGLang without its GPU dependencies (scripts/sglang-no-deps.txt)"
  "${PIP[@]}" --no-deps -r scripts/sglang-no-deps.txt
fi

if [[ $MODE == test ]]; then
  GPU_TRITON=$(grep -v '^#' scripts/gpu-image-triton.txt)
  GPU_TRITON_DIR="${TESSERA_CACHE:-$HOME/.cache/tessera}/gpu-image-triton/${GPU_TRITON#triton==}"
  if [[ ! -f $GPU_TRITON_DIR/triton/__init__.py ]]; then
    echo "== python packages: $GPU_TRITON beside the installed one, for the compile tests (then cached)"
    rm -rf "$GPU_TRITON_DIR.tmp"
    "${PIP[@]}" --no-deps --target "$GPU_TRITON_DIR.tmp" "$GPU_TRITON"
    mv "$GPU_TRITON_DIR.tmp" "$GPU_TRITON_DIR"
  fi
fi

echo "== control-plane binaries (cold build: tens of minutes; then cached)"
if [[ $MODE == demo ]]; then
  "$PYTHON" -m tessera dev-cluster build --cluster-only
  exit 0
fi
"$PYTHON" -m tessera dev-cluster build

echo "== weight-fetch test servers: S3 and GCS (Go module proxy), olah's venv (then cached)"
"$PYTHON" tests/stores.py >/dev/null
