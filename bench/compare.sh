#!/usr/bin/env bash
# On the GPU: the benchmark libraries of this checkout (target/models) beside
# those of another commit (OLD, a models folder built there with
# scripts/build_gpu_libs.sh), each pair measured in one process on the same
# weights against the same PyTorch peer (bench/k2_bench.py, bench/k3_bench.py):
#   bench/compare.sh OLD_MODELS_DIR [k2|k3|all]
# Writes $OUT/compare_k2.json and $OUT/compare_k3.json and prints their tables.
set -uo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: bench/compare.sh OLD_MODELS_DIR [k2|k3|all]}
which=${2:-all}
out=${OUT:-/tmp/mkc_out}
mkdir -p "$out"
libs() {  # names...: --lib OLD --lib NEW for each that exists in both
  for name in "$@"; do
    if [ -f "$old/$name/lib$name.so" ] && [ -f "target/models/$name/lib$name.so" ]; then
      printf -- '--lib\n%s\n--lib\n%s\n' "$old/$name/lib$name.so" "target/models/$name/lib$name.so"
    fi
  done
}
rc=0
if [ "$which" != k3 ]; then
  mapfile -t args < <(libs kimi_k2_bench_h200 kimi_k2_bench_b8_h200)
  python3 bench/k2_bench.py --config model_graphs/kimi_k2/bench_4l64e.json "${args[@]}" --json "$out/compare_k2.json" || rc=1
fi
if [ "$which" != k2 ]; then
  mapfile -t args < <(libs kimi_k3_dims_8l96e_h200 kimi_k3_dims_8l96e_b4_h200)
  python3 bench/k3_bench.py --config model_graphs/kimi_k3/test_8l96e.json "${args[@]}" --json "$out/compare_k3.json" || rc=1
fi
exit $rc
