#!/usr/bin/env bash
# Regenerates generated/ from the model graphs: the tiny configs and the full
# 93-layer K3 and the full K2 (FP8, as released) for every target, Kimi
# Linear's full config, K2's per-layer-dims config and its tiny config in FP8
# for the H200, speculative verify steps of K2 and K3 (tiny, and the full
# K3 for the GB300), and expert-parallel programs of K2 and K3 tiny (one GPU
# of two). With --check (CI), fails if anything
# differs from what is committed, then compiles every generated program with
# nvcc for its target, reporting each one's time and peak memory. The sources
# are formatted with the pinned clang-format (templates/clang-format).
#
# Plan files (plan.mkcplan) of the tiny configs are committed; those of the
# full-size models are not (megabytes that change with every plan change):
# their plan_summary.txt (section sizes, sha256) is, so the diff sees them.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet
scripts/toolchain.sh > /dev/null
clang_format=.toolchain/site/clang_format/data/bin/clang-format
gen() {  # model config target folder [codegen flags]
  rm -rf "generated/$4"
  ./target/release/mkc codegen "model_graphs/$1/graph.mkc" --config "model_graphs/$1/$2" --target "$3" \
    -o "generated/$4" "${@:5}" > /dev/null
  # Formatted by the pinned clang-format (templates/clang-format).
  "$clang_format" -i --style=file:templates/clang-format "generated/$4"/*.cuh "generated/$4"/*.cu
}
for model in kimi_k2 kimi_k3 kimi_linear; do
  for target in h200 b200 gb300; do
    gen "$model" tiny.json "$target" "${model}_tiny_${target}"
  done
done
# The full K3 (1.56 TB of weights) and K2 (about 1 TB in FP8) fit no single
# GPU: codegen refuses them unless told that these folders check the code, not
# a deployment.
for target in h200 b200 gb300; do
  gen kimi_k3 config.json "$target" "kimi_k3_${target}" --ignore-capacity
  gen kimi_k2 config.json "$target" "kimi_k2_${target}" --ignore-capacity  # Kimi K2 as released: FP8, 61 layers, 384 experts
done
gen kimi_k2 tiny_fp8.json h200 kimi_k2_tiny_fp8_h200
gen kimi_linear config.json h200 kimi_linear_h200
gen kimi_k2 test_2l16e.json h200 kimi_k2_dims_2l16e_h200
# Speculative verify steps (`--positions`): K2 and K3 tiny, 2 sequences of 4 positions; the full K3 on
# the GB300, one sequence of 4 positions.
gen kimi_k2 tiny.json h200 kimi_k2_tiny_b2_t4_h200 --batch 2 --positions 4
gen kimi_k3 tiny.json h200 kimi_k3_tiny_b2_t4_h200 --batch 2 --positions 4
gen kimi_k3 config.json gb300 kimi_k3_t4_gb300 --positions 4 --ignore-capacity
# One GPU's program of two (`--expert-parallel 2`: the routed experts sharded, each MoE layer's
# parts exchanged), K2 tiny for every target and K3 tiny for the H200: compiled here; the runtime
# launches one GPU so far.
for target in h200 b200 gb300; do
  gen kimi_k2 tiny.json "$target" "kimi_k2_tiny_ep2_${target}" --expert-parallel 2
done
gen kimi_k3 tiny.json h200 kimi_k3_tiny_ep2_h200 --expert-parallel 2
if [ "${1:-}" = "--check" ]; then
  untracked=$(git ls-files --others --exclude-standard -- generated)
  if ! git diff --quiet HEAD -- generated || [ -n "$untracked" ]; then
    git diff --stat HEAD -- generated
    [ -z "$untracked" ] || printf 'not committed:\n%s\n' "$untracked"
    echo "generated/ is out of date: run scripts/generate.sh and commit the result" >&2
    exit 1
  fi
  tmp=$(mktemp -d)
  for dir in generated/*/; do
    name=$(basename "$dir")
    start=$(date +%s)
    if [ -x /usr/bin/time ]; then
      /usr/bin/time -f "%M" -o "$tmp/$name.mem" scripts/build_model.sh "$dir" "$tmp/$name" --object-only
      peak="$(( $(tail -n 1 "$tmp/$name.mem") / 1024 )) MB peak"
    else
      scripts/build_model.sh "$dir" "$tmp/$name" --object-only
      peak="(no /usr/bin/time: peak memory not measured)"
    fi
    lines=$(cat "$dir"/*.cuh "$dir"/*.cu | wc -l)
    printf '%-32s %6s lines  %4ss  %s\n' "$name" "$lines" "$(( $(date +%s) - start ))" "$peak"
  done
  rm -rf "$tmp"
  echo "generated/ is up to date and compiles"
fi
