#!/usr/bin/env bash
# The project's test command: the GPU scripts parse, format check, clippy
# with warnings denied, the device runtime compiled by nvcc for sm_90a,
# sm_100a and sm_103a, generated/ regenerated (any difference fails) and
# compiled, the C++ runtime's CPU tests, all Rust tests, the plan page in
# Chromium (tests/browser/run.sh; MKC_SKIP_BROWSER=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# The GPU harnesses and benchmarks run on the H200, not here: they must at
# least parse.
python3 -m py_compile tests/gpu/*.py bench/*.py python/*.py
for f in scripts/*.sh tests/gpu/*.sh tests/browser/*.sh bench/*.sh .ci/run; do bash -n "$f"; done
cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
scripts/build_device.sh
scripts/generate.sh --check
scripts/test_runtime.sh
cargo test --locked --release
tests/browser/run.sh
