#!/usr/bin/env bash
# On the device: builds the libraries whose sources scripts/device_sources.sh
# put in .carry/, all at once (one nvcc each, in parallel), with the device's
# own nvcc and the carried CuTe headers standing in for .toolchain/:
#   .carry/gen/NAME -> target/models/NAME      (tests/gpu/*, bench/*)
#   .carry/old/gen/NAME -> target/old/NAME     (bench/compare.sh target/old)
#   device/tests/{ops_test,ring_bench,hop_bench}.cu -> target/device/*_sm90a  (as scripts/build_device.sh)
# Logs under $OUT/build/; a line per library.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mkc_out}/build
mkdir -p "$out"
nvcc=$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")
cuda=$(dirname "$(dirname "$nvcc")")
"$nvcc" --version | tail -1
toolchain() {  # a source tree: a .toolchain/ scripts/toolchain.sh accepts, of this machine's nvcc
  local site=$1/.toolchain/site
  mkdir -p "$site/nvidia/cu13/bin" "$site/clang_format/data/bin" "$site/cutlass_library/source"
  printf '#!/bin/sh\nexec %s "$@"\n' "$nvcc" > "$site/nvidia/cu13/bin/nvcc"  # nvcc finds its headers from its own path
  chmod +x "$site/nvidia/cu13/bin/nvcc"
  local lib=$cuda/lib64; [ -d "$lib" ] || lib=$cuda/lib
  [ -e "$site/nvidia/cu13/lib" ] || ln -s "$lib" "$site/nvidia/cu13/lib"
  printf '#!/bin/sh\necho "clang-format is not on the device" >&2; exit 1\n' > "$site/clang_format/data/bin/clang-format"
  chmod +x "$site/clang_format/data/bin/clang-format"
  tar -xzf .carry/cutlass.tgz -C "$site/cutlass_library/source"
  sed -n 's/^pins="\(.*\)"$/\1/p' "$1/scripts/toolchain.sh" > "$1/.toolchain/.pins"
}
toolchain .
jobs=()
# MKC_DEVICE_TOOLS=0: the libraries only (a short call).
[ "${MKC_DEVICE_TOOLS:-1}" = 0 ] || jobs=("tool ops_test" "tool ring_bench" "tool hop_bench")
for dir in .carry/gen/*/; do jobs+=("new $(basename "$dir")"); done
if [ -d .carry/old ]; then
  toolchain .carry/old
  for dir in .carry/old/gen/*/; do jobs+=("old $(basename "$dir")"); done
  [ "${MKC_DEVICE_TOOLS:-1}" = 0 ] || jobs+=("oldtool ring_bench")
fi
build() {  # new|old NAME
  if [ "$1" = tool ]; then
    mkdir -p target/device
    .toolchain/site/nvidia/cu13/bin/nvcc -std=c++20 -O3 -Xcompiler -Wall -I device \
      -I .toolchain/site/cutlass_library/source/include -gencode=arch=compute_90a,code=sm_90a \
      -o "target/device/$2_sm90a" "device/tests/$2.cu" > "$out/$2.log" 2>&1
  elif [ "$1" = oldtool ]; then  # the baseline's, beside this checkout's: target/device/old_NAME_sm90a
    mkdir -p target/device
    (cd .carry/old && .toolchain/site/nvidia/cu13/bin/nvcc -std=c++20 -O3 -Xcompiler -Wall -I device \
      -I .toolchain/site/cutlass_library/source/include -gencode=arch=compute_90a,code=sm_90a \
      -o "../../target/device/old_$2_sm90a" "device/tests/$2.cu") > "$out/old_$2.log" 2>&1
  elif [ "$1" = new ]; then
    scripts/build_model.sh ".carry/gen/$2" "target/models/$2" > "$out/$2.log" 2>&1
  else
    (cd .carry/old && scripts/build_model.sh "gen/$2" "../../target/old/$2") > "$out/old_$2.log" 2>&1
  fi
  echo "$1 $2 rc=$?"
}
export -f build
export out
start=$(date +%s)
printf '%s\n' "${jobs[@]}" | xargs -P "$(nproc)" -I{} bash -c 'build {}'
echo "built in $(( $(date +%s) - start )) s"
