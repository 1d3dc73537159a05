#!/usr/bin/env bash
# Prepares, here, what a device call needs to build the GPU libraries on the
# device itself (16 cores there, two here; the device has nvcc but no CUTLASS
# and no registry): into .carry/ (git-ignored, carried with `carry: [".carry"]`)
#   gen/NAME      each library's generated sources (scripts/gpu_libs.txt, names matching PATTERN)
#   cutlass.tgz   the CuTe/CUTLASS headers of .toolchain/
#   old/          with --old COMMIT: that commit's device/, runtime/ and scripts/ and its
#                 generated sources of the benchmark libraries (the baseline of bench/compare.sh)
# Then, on the device: scripts/device_build.sh (see there).
#   scripts/device_sources.sh [--old COMMIT] [PATTERN]
set -euo pipefail
cd "$(dirname "$0")/.."
old=
if [ "${1:-}" = --old ]; then old=${2:?--old COMMIT}; shift 2; fi
pattern=${1:-*}
cargo build --release --locked --quiet
scripts/toolchain.sh > /dev/null
rm -rf .carry && mkdir -p .carry/gen
codegen() {  # mkc list-file pattern out-dir [configs-root]: the graph of the current folder, the configs of
  # configs-root (this checkout's, so that another commit runs the same configs)
  grep -v '^#' "$2" | while IFS=: read -r model name config batch; do
    # shellcheck disable=SC2254
    case "$name" in $3) ;; *) continue ;; esac
    "$1" codegen "model_graphs/$model/graph.mkc" --config "${5:-.}/model_graphs/$model/$config" \
      --target h200 --batch "$batch" -o "$4/$name" > /dev/null
  done
}
codegen "$PWD/target/release/mkc" scripts/gpu_libs.txt "$pattern" .carry/gen
tar -czf .carry/cutlass.tgz -C .toolchain/site/cutlass_library/source include
if [ -n "$old" ]; then
  tree=$(mktemp -d)
  git worktree add -q --detach "$tree" "$old"
  (cd "$tree" && cargo build --release --quiet)
  git archive --format=tar "$old" device runtime scripts | (mkdir -p .carry/old && tar -x -C .carry/old)
  mkdir -p .carry/old/gen
  # The benchmark libraries, as that commit's mkc writes them (its list: this one's names).
  for bench in 'kimi_k2_bench*' 'kimi_k3_dims*'; do
    (cd "$tree" && codegen "$tree/target/release/mkc" "$OLDPWD/scripts/gpu_libs.txt" "$bench" "$OLDPWD/.carry/old/gen" "$OLDPWD")
  done
  git worktree remove --force "$tree"
fi
du -sh .carry
echo "carry: [\".carry\"]; on the device: scripts/device_build.sh"
