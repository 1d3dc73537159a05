#!/usr/bin/env bash
# Builds the C++ runtime's checkpoint reader with its CPU tests (address and
# undefined-behaviour sanitizers on) and runs them on the fixture checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/runtime
mkdir -p "$out"
g++ -std=c++17 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I runtime/include runtime/src/checkpoint.cpp runtime/tests/checkpoint_test.cpp -o "$out/checkpoint_test"
"$out/checkpoint_test" tests/fixtures/checkpoints
