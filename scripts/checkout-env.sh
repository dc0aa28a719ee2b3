# Source this to import tessera from a checkout without installing it
# (for machines where `pip install -e .` is not possible, e.g. no network).
# It builds the package mapping from setup.py as symlinks in a temp dir.
_tessera_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_tessera_site=$(mktemp -d)
mkdir -p "$_tessera_site/tessera"
for _f in "$_tessera_root"/tessera/*; do ln -s "$_f" "$_tessera_site/tessera/"; done
for _d in operator runtime kernels; do ln -s "$_tessera_root/$_d" "$_tessera_site/tessera/$_d"; done
export PYTHONPATH="$_tessera_site${PYTHONPATH:+:$PYTHONPATH}"
unset _f _d _tessera_root
