#!/usr/bin/env bash
# THE demo (`make demo`): set up a fresh machine, then `tessera demo up`: a real local control
# plane with simulated H200 pools, the Helm chart, the operator running locally as the chart's
# ServiceAccount, the examples followed to Ready, their capacity plans and endpoints.
# Re-running it is safe (everything is reused or re-applied). `tessera demo down` undoes it.
# Extra arguments go to `tessera demo up` (e.g. --timeout 600).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The checkout's operator/ folder would shadow the standard library's operator module when
# `python -m` puts the working directory on sys.path (seen in a fresh venv); tessera comes
# from the editable install instead.
export PYTHONSAFEPATH=1
SECONDS=0

bash scripts/setup.sh demo
"$PYTHON" -m tessera demo up "$@"

echo
echo "make demo took ${SECONDS} s (set-up included)."
echo "Use the cluster:  eval \"\$($PYTHON -m tessera dev-cluster env)\"; kubectl get modeldeployments -A"
echo "Stop everything:  $PYTHON -m tessera demo down"
