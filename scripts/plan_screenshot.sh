#!/usr/bin/env bash
# Renders `mkc plan --html` in headless Chromium and saves a screenshot, to
# check that the page draws both views without a network.
# Usage: scripts/plan_screenshot.sh [GRAPH] [CONFIG] [TARGET] [OUT.png]
# Needs Debian's chromium (`apt-get install chromium`).
set -euo pipefail
cd "$(dirname "$0")/.."
graph=${1:-model_graphs/kimi_k2/graph.mkc}
config=${2:-model_graphs/kimi_k2/bench_4l64e.json}
target=${3:-h200}
out=${4:-plan.png}
html=$(mktemp --suffix=.html)
cargo run --release --quiet -- plan "$graph" --config "$config" --target "$target" --html "$html" > /dev/null
chromium --headless --no-sandbox --disable-gpu --window-size=1400,1600 --screenshot="$out" "file://$html" 2>/dev/null
test -s "$out"
echo "wrote $out from $html"
