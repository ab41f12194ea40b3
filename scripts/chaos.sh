#!/usr/bin/env bash
# The chaos suite on the compose cluster (integration-tests/tests/chaos.rs): builds the image
# (deploy/build-image.sh), then runs the suite against deploy/docker-compose.yml with the real
# model, checking the reliability contract C1-C7 under each fault.
#
# Usage: scripts/chaos.sh [smoke|full]
#   smoke  a decode node killed mid-stream, and one paused 8 s (CI runs this; a few minutes)
#   full   smoke, plus a prefill node killed during prefill and a decode node cut off the
#          network for 8 s
# Results: target/chaos/results.md, results.json and events-*.jsonl.
# Env: TANDEM_CHAOS_KEEP=1 leaves the cluster running afterwards (project "tandemchaos").
set -euo pipefail
cd "$(dirname "$0")/.."
level=${1:-smoke}
case "$level" in smoke|full) ;; *) echo "usage: $0 [smoke|full]" >&2; exit 2 ;; esac
deploy/build-image.sh
[ -f "${TANDEM_MODELS:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf" ] \
  || target/image/tandem model fetch
# --workspace: the same features as the test build, so nothing is rebuilt.
cargo test --workspace --test chaos -- --ignored --nocapture --exact "chaos_$level"
