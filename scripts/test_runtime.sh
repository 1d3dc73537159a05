#!/usr/bin/env bash
# Builds the C++ runtime's checkpoint reader with its CPU tests (address and
# undefined-behaviour sanitizers on) and runs them on the fixture checkpoints
# and the hostile corpus;
# then a generated model's runtime on the fixture and broken copies of it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/runtime
mkdir -p "$out"
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I runtime/include runtime/src/checkpoint.cpp runtime/tests/checkpoint_test.cpp -o "$out/checkpoint_test"
"$out/checkpoint_test" tests/fixtures/checkpoints
# The same reader over the hostile corpus, message for message as the compiler's
# checker (tests/checkpoint_corpus.rs); a FIFO shard must not block it: the
# timeout turns a hang into a failure.
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I runtime/include runtime/src/checkpoint.cpp runtime/tests/checkpoint_corpus_test.cpp -o "$out/checkpoint_corpus_test"
timeout 120 "$out/checkpoint_corpus_test" tests/fixtures/hostile_checkpoints "$out/corpus_scratch"
# The GPU layout of MXFP4 weights the runtime makes on upload.
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I device runtime/tests/mx_layout_test.cpp -o "$out/mx_layout_test"
# FP8 weights on the host: e4m3 codes and the bf16 copy made on upload.
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I device runtime/tests/fp8_layout_test.cpp -o "$out/fp8_layout_test"
"$out/fp8_layout_test"
"$out/mx_layout_test"
# Speculative decoding's rules (accepted drafts, the prompt-lookup drafter): decoding with any
# drafts gives greedy decoding's tokens.
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I device runtime/tests/speculative_test.cpp -o "$out/speculative_test"
"$out/speculative_test"

# The plan-file reader on the plan files of generated/: the right one reads; another
# model's, target's or format's, a truncated one and flipped bytes are refused by name.
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I runtime/include -I device runtime/tests/plan_file_test.cpp -o "$out/plan_file_test"
mkdir -p "$out/plan_scratch"
"$out/plan_file_test" generated "$out/plan_scratch"

# The runtime of a generated model (tiny K2, built with the pinned toolchain),
# opened on the transformers fixture and on broken copies of it.
scripts/build_model.sh generated/kimi_k2_tiny_h200 "$out/kimi_k2_tiny_h200" > /dev/null
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -I runtime/include runtime/tests/model_test.cpp \
  -L "$out/kimi_k2_tiny_h200" -lkimi_k2_tiny_h200 -Wl,-rpath,"$PWD/$out/kimi_k2_tiny_h200" -o "$out/model_test"
rm -rf "$out/model_scratch"
"$out/model_test" tests/fixtures/checkpoints/deepseek_v3_tiny "$out/model_scratch"
