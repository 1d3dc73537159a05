#!/usr/bin/env bash
# Compiles the device runtime (device/) with the pinned nvcc for every target:
# sm_90a (H200, the binary the GPU test runs), sm_100a (B200), sm_103a (GB300).
# Usage: scripts/build_device.sh [OUT_DIR]   (default: target/device)
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=$(scripts/toolchain.sh)
cu13=$(dirname "$(dirname "$nvcc")")
cutlass=.toolchain/site/cutlass_library/source
out=${1:-target/device}
mkdir -p "$out"
flags=(-std=c++20 -O3 -Xcompiler -Wall -I device -I "$cutlass/include" -L "$cu13/lib")
for arch in 90a 100a 103a; do
  "$nvcc" "${flags[@]}" -gencode="arch=compute_${arch},code=sm_${arch}" \
    -o "$out/skeleton_test_sm${arch}" device/tests/skeleton_test.cu
  echo "built $out/skeleton_test_sm${arch}"
done
# The device library's functions one by one against CPU references (run on the H200).
"$nvcc" "${flags[@]}" -gencode="arch=compute_90a,code=sm_90a" -o "$out/ops_test_sm90a" device/tests/ops_test.cu
echo "built $out/ops_test_sm90a"
# The page ring's streaming rate on its own (a measurement, run on the H200).
"$nvcc" "${flags[@]}" -gencode="arch=compute_90a,code=sm_90a" -o "$out/ring_bench_sm90a" device/tests/ring_bench.cu
echo "built $out/ring_bench_sm90a"
# What one dependent stage hop and a launch cost (a measurement, run on the H200).
"$nvcc" "${flags[@]}" -gencode="arch=compute_90a,code=sm_90a" -o "$out/hop_bench_sm90a" device/tests/hop_bench.cu
echo "built $out/hop_bench_sm90a"
