#!/usr/bin/env bash
# Builds a generated model's runtime with the pinned toolchain:
#   scripts/build_model.sh generated/kimi_k2_tiny_h200 [OUT_DIR] [--object-only]
# writes OUT_DIR/lib<name>.so (the C ABI of runtime/include/mkc/model.h), its
# plan file OUT_DIR/plan.mkcplan (the library reads it from beside itself) and
# OUT_DIR/<name>_generate. --object-only compiles model.cu and stops (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: scripts/build_model.sh GENERATED_DIR [OUT_DIR] [--object-only]}
name=$(basename "$dir")
out=${2:-target/models/$name}
case "$name" in
  *_h200) arch=90a ;;
  *_b200) arch=100a ;;
  *_gb300) arch=103a ;;
  *) echo "error: cannot tell the target of $dir (its name must end in _h200, _b200 or _gb300)" >&2; exit 2 ;;
esac
nvcc=$(scripts/toolchain.sh)
cu13=$(dirname "$(dirname "$nvcc")")
cutlass=.toolchain/site/cutlass_library/source
mkdir -p "$out"
flags=(${MKC_NVCC_FLAGS:-} -std=c++20 -O3 -lineinfo -gencode="arch=compute_${arch},code=sm_${arch}" --expt-relaxed-constexpr -Xcompiler -fPIC
  -I "$dir" -I device -I runtime/include -I "$cutlass/include")
if [ "${3:-}" = "--object-only" ]; then
  "$nvcc" "${flags[@]}" -c -o "$out/model.o" "$dir/model.cu"
  exit 0
fi
test -f "$dir/plan.mkcplan" || { echo "error: $dir has no plan.mkcplan (run mkc codegen)" >&2; exit 2; }
cp "$dir/plan.mkcplan" "$out/plan.mkcplan"
"$nvcc" "${flags[@]}" -shared -o "$out/lib$name.so" "$dir/model.cu" runtime/src/checkpoint.cpp \
  -L "$cu13/lib" -cudart static
"$nvcc" -std=c++20 -O2 -I runtime/include -o "$out/${name}_generate" runtime/tools/generate.cpp \
  -L "$out" -L "$cu13/lib" -l"$name" -Xlinker -rpath -Xlinker '$ORIGIN'
echo "$out/lib$name.so"
