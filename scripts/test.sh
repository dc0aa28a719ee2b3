#!/usr/bin/env bash
# THE test command (`make test`, and CI through .ci/run): set up, then run every test under
# tests/ (unit, kernels, e2e against the real local control plane). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The checkout's operator/ folder would shadow the standard library's operator module when
# `python -m` puts the working directory on sys.path (seen in a fresh venv); tessera comes
# from the editable install instead.
export PYTHONSAFEPATH=1

bash scripts/setup.sh

# Without a GPU, Triton kernels run in its interpreter.
command -v nvidia-smi >/dev/null 2>&1 || export TRITON_INTERPRET=1

echo "== pytest $*"
rc=0
# A hung test fails alone after 15 minutes instead of eating CI's whole budget.
"$PYTHON" -m pytest --timeout=900 "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
  # pytest's "no tests collected": fine for a selection that matched nothing, a broken suite
  # when the whole tree was asked for.
  if [[ $# -gt 0 ]]; then
    echo "no tests matched the selection: $*"
    exit 0
  fi
  echo "error: pytest collected no tests under tests/" >&2
fi
exit $rc
