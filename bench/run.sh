#!/usr/bin/env bash
# On the H200: the K2 benchmark (bench/k2_bench.py) with the libraries that
# scripts/build_model.sh built for model_graphs/kimi_k2/bench_4l64e.json
# (target/models/kimi_k2_bench_h200, batch 1; kimi_k2_bench_b8_h200, batch 8),
# then the tiny config with target/models/kimi_k2_tiny_h200, then K3 at its
# per-layer dimensions (bench/k3_bench.py) with target/models/kimi_k3_dims_8l96e_h200.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mkc_out}
mkdir -p "$out"
libs=()
for name in kimi_k2_bench_h200 kimi_k2_bench_b8_h200; do
  lib=target/models/$name/lib$name.so
  [ -f "$lib" ] && libs+=(--lib "$lib")
done
python3 bench/k2_bench.py --config model_graphs/kimi_k2/bench_4l64e.json "${libs[@]}" --json "$out/bench_k2.json" "$@"
# The tiny config (batch 1), at position 100: launch and synchronisation cost.
tiny=target/models/kimi_k2_tiny_h200/libkimi_k2_tiny_h200.so
if [ -f "$tiny" ]; then
  python3 bench/k2_bench.py --config model_graphs/kimi_k2/tiny.json --lib "$tiny" --pos 100 --json "$out/bench_tiny.json"
fi
# K3's per-layer dimensions, 8 layers, 96 MXFP4 experts (batch 1).
k3=target/models/kimi_k3_dims_8l96e_h200/libkimi_k3_dims_8l96e_h200.so
if [ -f "$k3" ]; then
  python3 bench/k3_bench.py --config model_graphs/kimi_k3/test_8l96e.json --lib "$k3" --json "$out/bench_k3.json" "$@"
fi
