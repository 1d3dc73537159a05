#!/usr/bin/env bash
# On the device, in one call of under ten minutes: build what scripts/device_sources.sh carried
# (scripts/device_build.sh), then the checks and benchmarks named, in order, each under its own
# time limit; every log packed into $OUT/logs.tgz (the device returns a few files, not a tree),
# the summary lines printed last.
#   scripts/device_call.sh STEP...
# STEPs:
#   quick          tests/gpu/run_all.sh quick (ops_test and seed 0 of every tiny library built)
#   verify         tests/gpu/run_all.sh verify (the verify libraries against plain greedy decoding)
#   compare[=DIMS] bench/compare.sh against the carried baseline (.carry/old, built into target/old;
#                  none where there is none) for K3 per-layer dims, DIMS as MKC_K3_DIMS (8l48e,
#                  3l256e; the card's default where none), one profiled step a library (its Chrome
#                  trace, packed with the logs under logs/trace)
#   fp8            bench/compare.sh fp8 (K2 dims in FP8 against the peer, batch 1 and 8, beside the
#                  carried baseline's where it has them), one profiled step a library (traces packed
#                  with the logs)
#   verify-bench   bench/compare.sh none verify (K3 per-layer dims' verify steps at T = 1, 2, 4, 8 against
#                  the peer verifying the same positions; the kimi_k3_dims_8l48e{,_t2,_t4,_t8}_h200
#                  libraries), one profiled step a library
#   ring[=mla]     device/tests/ring_bench.cu (the page ring's and the consumers' streaming rates; =mla: the MLA split's alone), then
#                  the baseline's where one was carried
#   racecheck=GROUP compute-sanitizer's racecheck (shared-memory hazards, every one reported) of the
#                  device-function tests of GROUP (ops_test GROUP: fp8, mla, mx, ...)
#   ncu=mla        Nsight Compute on ring_bench's MLA split (batch 1 and 8): stalls, memory load
#   sass=NAME      cuobjdump of library NAME (this checkout's): each function's registers, stack and
#                  shared memory, and the SASS (gzipped), into the logs
# The call ends by MKC_CALL_SECONDS (default 570) after it starts: each step's limit is cut to what
# is left of that, less 15 seconds to pack the logs, so they come back even when the steps overrun.
# e.g. here: scripts/device_sources.sh --old 0a797a6 'kimi_k3_tiny_*' 'kimi_k3_dims_3l256e_*', then
# run(command="scripts/device_call.sh quick verify compare=3l256e", carry=[".carry"]).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/mkc_out}
logs=$out/logs
mkdir -p "$logs"
t0=$(date +%s)
summary=()
note() { summary+=("[+$(($(date +%s) - t0)) s] $*"); echo "${summary[-1]}"; }
end=$((t0 + ${MKC_CALL_SECONDS:-570} - 15))
limit() {  # seconds: the step's own limit, or what is left of the call's where less (at least 1)
  local left=$((end - $(date +%s)))
  [ "$left" -lt "$1" ] || left=$1
  [ "$left" -gt 0 ] || left=1
  echo "$left"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OUT=$logs scripts/device_build.sh > "$logs/build.txt" 2>&1
note "built: $(grep -c 'rc=0' "$logs/build.txt") ok, failed: $(grep 'rc=[1-9]' "$logs/build.txt" | tr '\n' ' ')"
base=target/old  # the carried baseline's libraries (compare, fp8)
[ -d .carry/old ] || base=none
for step in "$@"; do
  case "$step" in
    quick)
      OUT=$logs timeout "$(limit 240)" tests/gpu/run_all.sh quick > "$logs/quick.txt" 2>&1
      note "quick rc=$? $(grep -c FAIL "$logs/quick.txt") FAIL lines"
      grep -hE "FAIL|rc=[1-9]" "$logs/quick.txt" "$logs/quick/ops_test.txt" 2>/dev/null | head -8
      ;;
    verify)
      OUT=$logs MKC_LIB_TIMEOUT=150 timeout "$(limit 330)" tests/gpu/run_all.sh verify > "$logs/verify.txt" 2>&1
      note "verify rc=$?"
      grep -hE "FAIL|rc=[1-9]|flipped" "$logs/verify.txt" | head -8
      ;;
    compare | compare=*)
      dims=${step#compare}
      dims=${dims#=}
      mkdir -p "$logs/trace"
      OUT=$out MKC_K3_DIMS=$dims MKC_BENCH_TRACE=$logs/trace timeout "$(limit 400)" bench/compare.sh "$base" k3 \
        > "$logs/compare.txt" 2>&1
      note "compare ${dims:-default} against $base rc=$?"
      grep -A12 "^library " "$logs/compare.txt"
      ;;
    fp8)
      mkdir -p "$logs/trace"
      OUT=$out MKC_BENCH_TRACE=$logs/trace timeout "$(limit 300)" bench/compare.sh "$base" fp8 > "$logs/fp8.txt" 2>&1
      note "fp8 against $base rc=$?"
      grep -A6 "^library " "$logs/fp8.txt"
      ;;
    verify-bench)
      mkdir -p "$logs/trace"
      OUT=$out MKC_BENCH_TRACE=$logs/trace timeout "$(limit 300)" bench/compare.sh none verify \
        > "$logs/verify_bench.txt" 2>&1
      note "verify-bench rc=$?"
      grep -A6 "^library " "$logs/verify_bench.txt"
      ;;
    ring | ring=mla)
      only=${step#ring}; only=${only#=}  # ring=mla: the MLA split's variants alone
      timeout "$(limit 120)" target/device/ring_bench_sm90a $only > "$logs/ring_bench.txt" 2>&1
      note "ring_bench $only rc=$?"
      if [ -z "$only" ] && [ -x target/device/old_ring_bench_sm90a ]; then  # the baseline's, right after, on the same card
        timeout "$(limit 120)" target/device/old_ring_bench_sm90a > "$logs/old_ring_bench.txt" 2>&1
        note "old ring_bench rc=$?"
      fi
      grep -h "^${only:-mx}" "$logs/ring_bench.txt" | head -12
      ;;
    racecheck=*)
      group=${step#racecheck=}
      sanitizer=$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")/compute-sanitizer
      [ -x "$sanitizer" ] || sanitizer=compute-sanitizer
      timeout "$(limit 200)" "$sanitizer" --tool racecheck --racecheck-report all --error-exitcode 3 \
        target/device/ops_test_sm90a "$group" > "$logs/racecheck_$group.txt" 2>&1
      note "racecheck ops_test $group rc=$? ($(grep -c PASS "$logs/racecheck_$group.txt") PASS, $(grep -c FAIL "$logs/racecheck_$group.txt") FAIL lines)"
      grep -E "RACECHECK SUMMARY|hazard|ERROR SUMMARY" "$logs/racecheck_$group.txt" | head -4
      ;;
    sass=*)
      name=${step#sass=}
      lib=target/models/$name/lib$name.so
      cuobjdump=$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")/cuobjdump
      "$cuobjdump" -res-usage "$lib" > "$logs/sass_${name}_res.txt" 2>&1
      "$cuobjdump" -sass "$lib" 2> "$logs/sass_$name.err" | gzip > "$logs/sass_$name.txt.gz"
      note "sass $name rc=$? ($(wc -l < "$logs/sass_${name}_res.txt") lines of resource usage)"
      ;;
    ncu=mla)
      # Nsight Compute on ring_bench's MLA split at batch 1 and 8 (a 256 MiB cache: the replays save
      # and restore it): where its warps stall, the memory system's load.
      ncu=$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")/ncu
      command -v ncu > /dev/null && ncu=$(command -v ncu)
      for skip in 6 18; do  # each round: mla-idle-b1, mla-b1, mla-idle-b8, mla-b8, six launches each
        MKC_RING_MIB=256 timeout "$(limit 90)" "$ncu" --kernel-name regex:mla_stream --launch-skip $skip \
          --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
          target/device/ring_bench_sm90a mla > "$logs/ncu_mla_skip$skip.txt" 2>&1
        note "ncu mla (launch $skip) rc=$?"
        grep -E "Duration|Stall|Issued Warp|No Eligible|Memory Throughput" "$logs/ncu_mla_skip$skip.txt" | head -14
      done
      ;;
    *) note "unknown step $step (quick, verify, compare[=DIMS], fp8, verify-bench, ring[=mla], ncu=mla, racecheck=GROUP, sass=NAME)" ;;
  esac
done
tar -czf "$out/logs.tgz" -C "$out" logs && rm -rf "$logs"
printf '%s\n' "${summary[@]}"
