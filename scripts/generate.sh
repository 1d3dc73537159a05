#!/usr/bin/env bash
# Regenerates generated/ from the model graphs (tiny configs, every target).
# With --check (CI), fails if anything differs from what is committed, then
# compiles every generated header with nvcc for its target.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet
# Every model compiles to a whole program (tables, weights, program, runtime).
for model in kimi_k2 kimi_k3 kimi_linear; do
  for target in h200 b200 gb300; do
    ./target/release/mkc codegen "model_graphs/$model/graph.mkc" --config "model_graphs/$model/tiny.json" \
      --target "$target" -o "generated/${model}_tiny_${target}" > /dev/null
  done
done
if [ "${1:-}" = "--check" ]; then
  untracked=$(git ls-files --others --exclude-standard -- generated)
  if ! git diff --quiet HEAD -- generated || [ -n "$untracked" ]; then
    git diff --stat HEAD -- generated
    [ -z "$untracked" ] || printf 'not committed:\n%s\n' "$untracked"
    echo "generated/ is out of date: run scripts/generate.sh and commit the result" >&2
    exit 1
  fi
  nvcc=$(scripts/toolchain.sh)
  cutlass=.toolchain/site/cutlass_library/source
  tmp=$(mktemp -d)
  for dir in generated/*/; do
    name=$(basename "$dir")
    case "$name" in *_h200) arch=90a ;; *_b200) arch=100a ;; *_gb300) arch=103a ;; *) continue ;; esac
    if [ -f "$dir/model.cu" ]; then
      scripts/build_model.sh "$dir" "$tmp/$name" --object-only
      continue
    fi
    printf '#include "plan_tables.h"\n#include "weights.h"\n' > "$tmp/$name.cu"
    "$nvcc" -std=c++17 -c -gencode="arch=compute_${arch},code=sm_${arch}" -I "$dir" -I device -I runtime/include \
      -I "$cutlass/include" -o "$tmp/$name.o" "$tmp/$name.cu"
  done
  rm -rf "$tmp"
  echo "generated/ is up to date and compiles"
fi
