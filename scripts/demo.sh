#!/usr/bin/env bash
# The demo, for now: a real local control plane with simulated H200 pools, and its GPU nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

bash scripts/setup.sh
"$PYTHON" -m tessera dev-cluster up
eval "$("$PYTHON" -m tessera dev-cluster env)"

echo
kubectl version
echo
echo "GPU nodes:"
kubectl get nodes -o custom-columns='NAME:.metadata.name,POOL:.metadata.labels.tessera\.dev/pool,PRODUCT:.metadata.labels.nvidia\.com/gpu\.product,GPUS:.status.allocatable.nvidia\.com/gpu,READY:.status.conditions[?(@.type=="Ready")].status'
echo
echo "The cluster keeps running. Use it:  eval \"\$(tessera dev-cluster env)\"; kubectl get nodes"
echo "Stop it:                            tessera dev-cluster down"
