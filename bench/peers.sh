#!/usr/bin/env bash
# The production peers the kernel benchmarks time ours against, made ready for the GPU machine
# (which reaches no package index): FlashMLA (the sgl-flash-mla wheel, stable torch ABI),
# SGLang 0.5.23's kernel sources (its Triton files, read by sglang_source.py, and the CUDA
# sources of its JIT kernels), those JIT kernels built ahead of time (Marlin dense, MoE and
# repack; the routers' tiny GEMM for Kimi K2 and GLM 5), and the small Python packages the
# benchmarks import there.
#
#   bash bench/peers.sh fetch [DIR]     # here (network): wheels and SGLang's sources -> DIR
#   bash bench/peers.sh build [DIR]     # here (no GPU needed): the JIT kernels -> DIR/jit, with
#                                       # nvcc from NVIDIA's CUDA 13.0 pip wheels (cached)
#   eval "$(bash bench/peers.sh install [DIR])"   # on the GPU machine: a site folder with
#                                       # tessera (this tree) and the wheels; sets PYTHONPATH
#
# DIR defaults to .peers (git-ignored; carry it to the GPU machine). Then, for example:
#   python bench/w4a16_bench.py --marlin .peers/jit ...
#   python bench/decode_slice.py --sglang-src .peers/sglang --sglang-jit-dir .peers/jit ...
set -euo pipefail
cd "$(dirname "$0")/.."
action=${1:-}
dir=${2:-.peers}
PYTHON=${PYTHON:-python3}
SGLANG=0.5.23
FLASH_MLA=1.0.0
TVM_FFI=0.1.11  # the version SGLang 0.5.23's JIT loader builds against
CUDA=13.0       # the GPU machine's torch is a CUDA 13.0 build
CACHE=${TESSERA_CACHE:-$HOME/.cache/tessera}

# SGLang's files the benchmarks read: its Triton kernels (bench/sglang_source.py) ...
TRITON_FILES=(ops/moe/fused_moe_triton_kernels.py ops/quantization/fp8_kernel.py
              ops/moe/moe_fused_gate.py)
# ... and the JIT kernels' sources (bench/sglang_jit_build.py's units and their includes).
JIT_PATHS=(jit/include/ jit/csrc/gemm/marlin/ jit/csrc/gemm/marlin_moe/
           jit/csrc/gemm/tiny_gemm.cuh)

fetch() {
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$dir/wheels" "$dir/sglang"
  echo "== wheels -> $dir/wheels"
  "$PYTHON" -m pip download -q --no-deps -d "$dir/wheels" "sgl-flash-mla==$FLASH_MLA"
  # The GPU machine's Python may be 3.11 or 3.12: a wheel for each, pip picks there.
  for py in 3.11 3.12; do
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version "$py" \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir/wheels" \
      "apache-tvm-ffi==$TVM_FFI" "pydantic>=2.6"
  done
  echo "== SGLang $SGLANG's kernel sources -> $dir/sglang"
  "$PYTHON" -m pip download -q --no-deps -d "$tmp" "sglang==$SGLANG"
  local wheel=("$tmp"/sglang-*.whl)
  local members=()
  for f in "${TRITON_FILES[@]}" "${JIT_PATHS[@]}"; do members+=("sglang/kernels/$f*"); done
  unzip -q -o "${wheel[0]}" "${members[@]}" -d "$tmp/x"
  for f in "${TRITON_FILES[@]}"; do cp "$tmp/x/sglang/kernels/$f" "$dir/sglang/"; done
  rm -rf "$dir/sglang/jit"
  cp -r "$tmp/x/sglang/kernels/jit" "$dir/sglang/jit"
  du -sh "$dir"
}

build() {
  local cuda="$CACHE/cuda-$CUDA"
  if [[ ! -x "$cuda/nvidia/cu13/bin/nvcc" ]]; then
    echo "== nvcc and the CUDA $CUDA headers from NVIDIA's pip wheels -> $cuda"
    "$PYTHON" -m pip install -q --no-deps --target "$cuda" "nvidia-cuda-nvcc==$CUDA.*" \
      "nvidia-cuda-crt==$CUDA.*" "nvidia-cuda-runtime==$CUDA.*" "nvidia-cuda-cccl==$CUDA.*" \
      "nvidia-nvvm==$CUDA.*" "apache-tvm-ffi==$TVM_FFI"
  fi
  local lib="$cuda/nvidia/cu13/lib"
  # The linker asks for libcudart.so; the runtime wheel ships only the versioned name.
  [[ -e "$lib/libcudart.so" ]] || ln -s libcudart.so.13 "$lib/libcudart.so"
  echo "== SGLang's JIT kernels -> $dir/jit (several minutes; progress per unit)"
  PATH="$cuda/nvidia/cu13/bin:$PATH" PYTHONPATH="$cuda${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" bench/sglang_jit_build.py --src "$dir/sglang/jit" --out "$dir/jit" \
    --router 384:7168 --router 256:6144
  rm -f "$dir"/jit/*.o  # only the modules travel
  du -sh "$dir"
}

install() {
  local site=/tmp/tessera-peers-site root
  root=$(pwd)
  mkdir -p "$site/tessera"
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" --find-links "$dir/wheels" \
    sgl-flash-mla apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
    typing-extensions >&2
  # tessera from this tree, as setup.py maps its folders (nothing to build there).
  for f in tessera/*; do ln -sfn "$root/$f" "$site/tessera/"; done
  for pkg in operator runtime kernels; do ln -sfn "$root/$pkg" "$site/tessera/$pkg"; done
  echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "$action" in
  fetch) fetch ;;
  build) build ;;
  install) install ;;
  *) echo "usage: bash bench/peers.sh fetch|build|install [DIR]  (see the comment at its top)" >&2
     exit 2 ;;
esac
