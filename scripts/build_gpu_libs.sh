#!/usr/bin/env bash
# Builds, here, every library the H200 runs need (tests/gpu/run_k2.sh,
# bench/run.sh), into target/models/ (carry it to the device; or build them on
# the device itself: scripts/device_sources.sh), the list in scripts/gpu_libs.txt:
#   kimi_k2_tiny_h200, kimi_k2_tiny_b4_h200     tiny config, batch 1 and 4
#   kimi_k2_dims_2l16e_h200                     K2 per-layer dimensions, 2 layers, 16 experts
#   kimi_k2_bench_h200, kimi_k2_bench_b8_h200   the benchmark config, batch 1 and 8
#   kimi_linear_tiny_h200, kimi_linear_tiny_b4_h200   Kimi Linear's tiny config, batch 1 and 4
#   kimi_k3_tiny_h200, kimi_k3_tiny_b4_h200           K3's tiny config (MXFP4 experts), batch 1 and 4
#   kimi_k3_dims_8l96e_h200, kimi_k3_dims_8l96e_b4_h200   K3's per-layer dimensions, 8 layers, 96 experts,
#                                                         batch 1 and 4
# Usage: [MKC_MODELS_DIR=DIR] scripts/build_gpu_libs.sh [PATTERN]   into DIR (default
# target/models), only the names matching the shell
# pattern (e.g. 'kimi_k3_*'): each library is a few MB and a device call
# carries at most 64 MiB, so carry subsets when all of them do not fit.
set -euo pipefail
cd "$(dirname "$0")/.."
pattern=${1:-*}
models=${MKC_MODELS_DIR:-target/models}
cargo build --release --locked --quiet
grep -v '^#' scripts/gpu_libs.txt | while IFS=: read -r model name config batch positions; do
  # shellcheck disable=SC2254
  case "$name" in $pattern) ;; *) continue ;; esac
  ./target/release/mkc codegen "model_graphs/$model/graph.mkc" --config "model_graphs/$model/$config" \
    --target h200 --batch "$batch" ${positions:+--positions "$positions"} -o "target/gen/$name" > /dev/null
  scripts/build_model.sh "target/gen/$name" "$models/$name"
done
