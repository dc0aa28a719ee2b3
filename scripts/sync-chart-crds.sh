#!/usr/bin/env bash
# Copy the CRDs (crds/*.yaml, the one source) into the Helm chart, which must ship them verbatim
# in its crds/ folder. `--check` changes nothing and fails when the copies differ; the unit
# tests (tests/unit/test_chart.py) make the same comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=crds
DST=charts/tessera-operator/crds

check=false
case "${1:-}" in
  --check) check=true ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

$check || mkdir -p "$DST"
stale=0
for src in "$SRC"/*.yaml; do
  dst="$DST/$(basename "$src")"
  if ! cmp -s "$src" "$dst"; then
    stale=1
    if $check; then echo "differs: $dst (from $src)"; else cp "$src" "$dst"; echo "copied $src -> $dst"; fi
  fi
done
for dst in "$DST"/*.yaml; do
  [[ -e "$dst" ]] || continue
  if [[ ! -e "$SRC/$(basename "$dst")" ]]; then
    stale=1
    if $check; then echo "not in $SRC: $dst"; else rm "$dst"; echo "removed $dst"; fi
  fi
done

if $check && [[ $stale -ne 0 ]]; then
  echo "the chart's CRDs differ from $SRC/: run scripts/sync-chart-crds.sh" >&2
  exit 1
fi
