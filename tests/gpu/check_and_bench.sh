#!/usr/bin/env bash
# One device call: the device-function tests, a smoke decode of the tiny
# config, then (if those pass) every K2-family library against transformers
# (seeds 0 1 2) and the benchmark with a profiled step per library.
# Libraries from scripts/build_gpu_libs.sh and scripts/build_device.sh
# (carry target/models and target/device). Logs under $OUT; a table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
final=${OUT:-/tmp/mkc_out}
out=$(mktemp -d)  # logs; what comes back: logs.tgz, the traces and bench_k2.json in $OUT
mkdir -p "$final"
summary=()
timeout 60 target/device/ops_test_sm90a > "$out/ops_test.txt" 2>&1
summary+=("ops_test rc=$?")
timeout 90 python3 tests/gpu/deepseek_v3_decode.py --lib target/models/kimi_k2_tiny_h200/libkimi_k2_tiny_h200.so \
  --config model_graphs/kimi_k2/tiny.json --seeds 0 > "$out/smoke.log" 2>&1
smoke=$?
summary+=("smoke rc=$smoke")
if [ $smoke = 0 ]; then
  OUT=$out timeout 240 tests/gpu/run_k2.sh 0 1 2 > "$out/correctness.txt" 2>&1
  summary+=("correctness rc=$?")
  OUT=$out timeout 200 bench/run.sh --trace "$out/trace" > "$out/bench.txt" 2>&1
  summary+=("bench rc=$?")
fi
cat "$out/ops_test.txt"
tail -n 5 "$out/smoke.log"
grep -E "^lib|\.so |PASS|FAIL|refused" "$out/correctness.txt" 2>/dev/null
grep -v "Writing\|Loading" "$out/bench.txt" 2>/dev/null | grep -E "^profile|^  [a-z]|^library|\.so " | grep -vE "layer\.[123]/"
printf '%s\n' "${summary[@]}"
[ -d "$out/trace" ] && cp "$out"/trace/*.json "$final/"
[ -f "$out/bench_k2.json" ] && cp "$out/bench_k2.json" "$final/"
tar -C "$out" -czf "$final/logs.tgz" .
