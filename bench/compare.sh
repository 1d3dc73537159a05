#!/usr/bin/env bash
# On the GPU: the benchmark libraries of this checkout (target/models) beside
# those of another commit (OLD, a models folder built there with
# scripts/build_gpu_libs.sh), at batch 1, 2, 4 and 8 where both have the
# library, each pair measured in one process on the same
# weights against the same PyTorch peer (bench/k2_bench.py, bench/k3_bench.py):
#   bench/compare.sh OLD_MODELS_DIR [k2|k3|fp8|verify|all]   (fp8: the baseline's libraries where it has
#   them; verify: this checkout's libraries and the peer only, K3 per-layer dims' verify steps at T = 1, 2,
#   4, 8; OLD_MODELS_DIR none: this checkout's libraries alone)
# Writes $OUT/compare_k2.json and $OUT/compare_k3.json and prints their tables; MKC_BENCH_TRACE=DIR
# adds one profiled step per library (Chrome trace JSON, for `mkc plan --estimate --trace`).
set -uo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: bench/compare.sh OLD_MODELS_DIR [k2|k3|fp8|all]}
which=${2:-all}
out=${OUT:-/tmp/mkc_out}
mkdir -p "$out"
libs() {  # names...: --lib OLD --lib NEW for each that exists in both (OLD none: --lib NEW for each here)
  for name in "$@"; do
    if [ "$old" = none ] && [ -f "target/models/$name/lib$name.so" ]; then
      printf -- '--lib\n%s\n' "target/models/$name/lib$name.so"
    elif [ -f "$old/$name/lib$name.so" ] && [ -f "target/models/$name/lib$name.so" ]; then
      printf -- '--lib\n%s\n--lib\n%s\n' "$old/$name/lib$name.so" "target/models/$name/lib$name.so"
    fi
  done
}
trace=()
[ -n "${MKC_BENCH_TRACE:-}" ] && trace=(--trace "$MKC_BENCH_TRACE")
rc=0
if [ "$which" = k2 ] || [ "$which" = all ]; then
  mapfile -t args < <(libs kimi_k2_bench_h200 kimi_k2_bench_b2_h200 kimi_k2_bench_b4_h200 kimi_k2_bench_b8_h200)
  python3 bench/k2_bench.py --config model_graphs/kimi_k2/bench_4l64e.json "${args[@]}" "${trace[@]}" --json "$out/compare_k2.json" || rc=1
fi
if [ "$which" = k3 ] || [ "$which" = all ]; then
  # K3's per-layer dimensions with 96 experts: two libraries and the peer's bf16 experts need more than
  # an 80 GB card holds; there, the same layers with 48 experts (the same bytes a step at batch 1).
  # MKC_K3_DIMS picks another config's libraries on any card: 8l48e, or 3l256e (3 layers, 256 experts:
  # at batch 8 most experts are picked by one token, as K3's 896 are).
  dims=${MKC_K3_DIMS:-8l96e}
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  if [ -z "${MKC_K3_DIMS:-}" ] && [ -n "$mem" ] && [ "$mem" -lt 100000 ]; then dims=8l48e; fi
  echo "K3 per-layer dimensions: test_$dims.json (card memory ${mem:-unknown} MiB)"
  mapfile -t args < <(libs "kimi_k3_dims_${dims}_h200" "kimi_k3_dims_${dims}_b2_h200" "kimi_k3_dims_${dims}_b4_h200" \
    "kimi_k3_dims_${dims}_b8_h200")
  python3 bench/k3_bench.py --config "model_graphs/kimi_k3/test_$dims.json" "${args[@]}" "${trace[@]}" --json "$out/compare_k3.json" || rc=1
fi
if [ "$which" = fp8 ] || [ "$which" = all ]; then
  # K2 as released (FP8): this checkout's libraries against the peer, each beside the baseline's where it
  # has one (a baseline commit may predate FP8).
  args=()
  for name in kimi_k2_bench_fp8_h200 kimi_k2_bench_fp8_b8_h200; do
    [ -f "target/models/$name/lib$name.so" ] || continue
    [ "$old" != none ] && [ -f "$old/$name/lib$name.so" ] && args+=(--lib "$old/$name/lib$name.so")
    args+=(--lib "target/models/$name/lib$name.so")
  done
  if [ ${#args[@]} -gt 0 ]; then
    python3 bench/k2_bench.py --config model_graphs/kimi_k2/bench_4l64e_fp8.json --fp8 "${args[@]}" "${trace[@]}" \
      --json "$out/compare_fp8.json" || rc=1
  fi
fi
if [ "$which" = verify ]; then
  # K3's verify step (per-layer dims, 48 experts: fits an 80 GB card) at T = 1 (the single-token step),
  # 2, 4 and 8, this checkout's libraries, each against the peer verifying the same positions.
  args=()
  for name in kimi_k3_dims_8l48e_h200 kimi_k3_dims_8l48e_t2_h200 kimi_k3_dims_8l48e_t4_h200 kimi_k3_dims_8l48e_t8_h200; do
    [ -f "target/models/$name/lib$name.so" ] && args+=(--lib "target/models/$name/lib$name.so")
  done
  if [ ${#args[@]} -gt 0 ]; then
    python3 bench/k3_bench.py --config model_graphs/kimi_k3/test_8l48e.json "${args[@]}" "${trace[@]}" \
      --json "$out/compare_verify.json" || rc=1
  fi
fi
exit $rc
