#!/usr/bin/env bash
# On the H200: the compiled K2-family and Kimi Linear models against transformers,
# and K3 against the project's K3 reference (tests/gpu/k3_decode.py).
#   tests/gpu/run_k2.sh [SEEDS...]   (libraries from scripts/build_model.sh under target/models/)
# Logs and JSON reports go to $OUT (default /tmp/mkc_out); a table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/mkc_out}
mkdir -p "$out"
seeds=${*:-0 1 2}
status=0
summary=()
for dir in target/models/*/; do
  name=$(basename "$dir")
  lib="$dir/lib$name.so"
  [ -f "$lib" ] || continue
  config=model_graphs/kimi_k2/tiny.json
  extra=()
  case "$name" in
    kimi_k2_bench*) continue ;;  # bench/k2_bench.py
    kimi_k2_tiny_h200) extra=(--bad-checkpoints) ;;
    kimi_k2_tiny_fp8*) config=model_graphs/kimi_k2/tiny_fp8.json; extra=(--fp8) ;;
    kimi_k2_dims_fp8*) config=model_graphs/kimi_k2/test_2l16e_fp8.json; extra=(--fp8) ;;
    kimi_k2_dims*) config=model_graphs/kimi_k2/test_2l16e.json ;;
    kimi_linear_*) config=model_graphs/kimi_linear/tiny.json; extra=(--arch kimi_linear) ;;
  esac
  script=tests/gpu/deepseek_v3_decode.py
  case "$name" in
    kimi_k3_dims*) dims=${name#kimi_k3_dims_}; script=tests/gpu/k3_decode.py
      config=model_graphs/kimi_k3/test_${dims%%_*}.json; extra=() ;;
    kimi_k3_*) script=tests/gpu/k3_decode.py; config=model_graphs/kimi_k3/tiny.json; extra=() ;;
  esac
  if [ "$script" = tests/gpu/k3_decode.py ]; then
    timeout "${MKC_LIB_TIMEOUT:-900}" python3 "$script" --lib "$lib" --config "$config" --seeds $seeds --json "$out/$name.json" \
      > "$out/$name.log" 2>&1 || status=1
  else
    timeout "${MKC_LIB_TIMEOUT:-900}" python3 "$script" --lib "$lib" --config "$config" --seeds $seeds \
      --json "$out/$name.json" ${MKC_DEBUG:+--debug} "${extra[@]}" > "$out/$name.log" 2>&1 || status=1
  fi
  summary+=("$(grep -v '^$' "$out/$name.log" | tail -n 12)")
done
printf '%s\n\n' "${summary[@]}"
exit $status
