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

echo "== python packages: pip install -e '.[test]'"
"${PIP[@]}" -e '.[test]'
# SGLang goes in without its GPU-only dependencies; on later runs pip's resolver lists those as
# "not installed" conflicts after the line above. That is expected and harmless here.
if [[ -f scripts/sglang-no-deps.txt ]]; then
  echo "== python packages: SGLang without its GPU dependencies (scripts/sglang-no-deps.txt)"
  "${PIP[@]}" --no-deps -r scripts/sglang-no-deps.txt
fi

echo "== control-plane binaries (cold build: tens of minutes; then cached)"
"$PYTHON" -m tessera dev-cluster build
