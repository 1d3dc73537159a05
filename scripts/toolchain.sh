#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler (PyPI wheels) and the CUTLASS 4.2 /
# CuTe headers into .toolchain/ (git-ignored), then prints the nvcc path.
# nvvm is pinned on purpose: left alone it resolves to 13.5 and ptxas rejects its PTX.
# Re-running is cheap: an existing install of the same versions is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.toolchain
pins="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cutlass==4.2.0.0 clang-format==19.1.7"
stamp="$dest/.pins"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$pins" ]; then
  rm -rf "$dest"
  mkdir -p "$dest"
  # shellcheck disable=SC2086
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$dest/site" $pins
  echo "$pins" > "$stamp"
fi
cu13="$dest/site/nvidia/cu13"
cutlass="$dest/site/cutlass_library/source"
test -x "$cu13/bin/nvcc" || { echo "toolchain: nvcc missing under $cu13" >&2; exit 1; }
test -x "$dest/site/clang_format/data/bin/clang-format" || { echo "toolchain: clang-format missing" >&2; exit 1; }
test -f "$cutlass/include/cute/tensor.hpp" || { echo "toolchain: CuTe headers missing under $cutlass" >&2; exit 1; }
echo "$cu13/bin/nvcc"
