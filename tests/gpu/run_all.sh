#!/usr/bin/env bash
# One device session's worth of checks, in one call (libraries from
# scripts/build_gpu_libs.sh under target/models/, carried):
#   0. the device library's functions against CPU references (ops_test);
#   1. every K2-family library against transformers, seeds 0 1 2;
#   2. compute-sanitizer memcheck and racecheck on the tiny config;
#   3. the benchmark (K2 dims batch 1 and 8, and the tiny config).
# Logs and JSON under $OUT; a short table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/mkc_out}
mkdir -p "$out"
# The device library's functions one by one (scripts/build_device.sh; carry target/device too).
if [ -x target/device/ops_test_sm90a ]; then
  timeout 60 target/device/ops_test_sm90a > "$out/ops_test.txt" 2>&1
  echo "ops_test rc=$?" >> "$out/summary.txt"
fi
timeout 330 tests/gpu/run_k2.sh 0 1 2 > "$out/correctness.txt" 2>&1
echo "correctness rc=$?" >> "$out/summary.txt"
lib=target/models/kimi_k2_tiny_h200/libkimi_k2_tiny_h200.so
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/deepseek_v3_decode.py --lib $lib \
    --config model_graphs/kimi_k2/tiny.json --seeds 0 --gen 2 --prompt-len 3 > "$out/$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log")" >> "$out/summary.txt"
done
timeout 300 bench/run.sh > "$out/bench.txt" 2>&1
echo "bench rc=$?" >> "$out/summary.txt"
[ -f "$out/ops_test.txt" ] && cat "$out/ops_test.txt"
grep -E "^lib|\.so |PASS|FAIL|refused" "$out/correctness.txt"
grep -E "^library|\.so " "$out/bench.txt"
cat "$out/summary.txt"
