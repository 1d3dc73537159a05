#!/usr/bin/env bash
# The project's test command: format check, clippy with warnings denied, all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked --release
