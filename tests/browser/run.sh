#!/usr/bin/env bash
# The plan page in a real browser: installs Debian's Chromium (apt) and the
# pinned puppeteer-core (npm, package-lock.json) if missing, renders the full
# Kimi K3 plan on gb300 and the tiny one with `mkc plan --html`, and loads
# each in headless Chromium (check.mjs): no console error, interactive (time
# reported against the 2 s budget), a layer expands, a clicked fused
# operation shows its fusion reasons, the schedule zooms. Screenshots go to
# tests/browser/out/. Needs apt-get and npm (as root or through sudo);
# without them it fails, unless MKC_SKIP_BROWSER=1 says to skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${MKC_SKIP_BROWSER:-0}" = 1 ]; then
  echo "browser test skipped (MKC_SKIP_BROWSER=1)"
  exit 0
fi
fail() { echo "tests/browser/run.sh: $*" >&2; echo "(set MKC_SKIP_BROWSER=1 to skip this test on purpose)" >&2; exit 1; }
if [ "$(id -u)" = 0 ]; then
  sudo=()
elif command -v sudo > /dev/null && sudo -n true 2> /dev/null; then
  sudo=(sudo -n)
else
  sudo=(none)
fi
apt_install() {
  command -v apt-get > /dev/null || fail "$1 is missing and there is no apt-get to install it"
  [ "${sudo[0]:-}" != none ] || fail "$1 is missing and installing it needs root or password-less sudo"
  "${sudo[@]}" apt-get update -q || fail "apt-get update failed"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" || fail "apt-get install $* failed"
}
chromium=${CHROMIUM:-$(command -v chromium || true)}
if [ -z "$chromium" ]; then
  apt_install chromium
  chromium=$(command -v chromium) || fail "chromium is not on PATH after installing it"
fi
command -v node > /dev/null && command -v npm > /dev/null || apt_install nodejs npm
echo "$("$chromium" --version 2> /dev/null | head -1), node $(node --version)"
(cd tests/browser && npm ci --no-audit --no-fund --loglevel=error) || fail "npm ci failed (is the npm registry reachable?)"

out=tests/browser/out
mkdir -p "$out"
cargo build --release --locked --quiet
mkc=target/release/mkc
$mkc plan model_graphs/kimi_k3/graph.mkc --target gb300 --html "$out/plan_k3.html" > /dev/null
$mkc plan model_graphs/kimi_k3/graph.mkc --config model_graphs/kimi_k3/tiny.json --target h200 \
  --html "$out/plan_tiny.html" > /dev/null
export CHROMIUM="$chromium"
MKC_WRITE_TRACE="$out/trace_k3.json" node tests/browser/check.mjs "$out/plan_k3.html" "$out" plan_k3
# The same page with that (stand-in) measured step overlaid through --trace.
$mkc plan model_graphs/kimi_k3/graph.mkc --target gb300 --html "$out/plan_k3_measured.html" \
  --trace "$out/trace_k3.json" > /dev/null
MKC_EXPECT_MEASURED=1 node tests/browser/check.mjs "$out/plan_k3_measured.html" "$out" plan_k3_measured
node tests/browser/check.mjs "$out/plan_tiny.html" "$out" plan_tiny
echo "screenshots: $(ls "$out"/*.png | tr '\n' ' ')"
