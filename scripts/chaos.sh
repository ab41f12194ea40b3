#!/usr/bin/env bash
# The chaos suite on the compose cluster (integration-tests/tests/chaos.rs): builds the image
# with the test-only failpoints (deploy/build-image.sh tandem:chaos failpoints), then runs the
# suite against deploy/docker-compose.yml plus integration-tests/chaos/compose.yml with the real
# model, checking the reliability contract C1-C7 under each fault. Needs root (nsenter, iptables
# and tc in the containers' network namespaces) and Docker.
#
# Usage: scripts/chaos.sh [smoke|full|one NAME]
#   smoke     a decode node killed mid-stream, one paused 8 s, and through OpenAI HTTP streams:
#             the router given SIGTERM, and every decode node given SIGTERM at once (CI runs
#             this; a few minutes)
#   full      every scenario: node kills, pauses and disconnects, KV-path resets, loss, a
#             bandwidth cap and corruption, 100 ± 30 ms latency and a blackhole through
#             `tandem fault-proxy`, client cancels and deadlines, the session holder killed
#             between turns, the router killed, a rolling restart, a decode node's drain (killed
#             mid-way, racing client cancels, its peer full), the router's and every decode
#             node's SIGTERM with OpenAI HTTP streams, 3x overload, and a random-fault
#             soak (TANDEM_CHAOS_SOAK_S, default 600 s); about 35 minutes
#   one NAME  one scenario, e.g. `kv(loss)`, `overload`, `node(killprefill)`, `drain(killed)`,
#             `httprouterstop`, `httpdecodestop`
# Results: target/chaos/results.md, results.json and events-*.jsonl.
# Env: TANDEM_CHAOS_KEEP=1 leaves the cluster running afterwards (project "tandemchaos").
set -euo pipefail
cd "$(dirname "$0")/.."
level=${1:-smoke}
case "$level" in
  smoke|full) ;;
  one) [ $# -eq 2 ] || { echo "usage: $0 one NAME" >&2; exit 2; }; export TANDEM_CHAOS_ONLY=$2 ;;
  *) echo "usage: $0 [smoke|full|one NAME]" >&2; exit 2 ;;
esac
deploy/build-image.sh tandem:chaos failpoints
[ -f "${TANDEM_MODELS:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf" ] \
  || target/image/tandem model fetch smollm2
# --workspace: the same features as the test build, so nothing is rebuilt.
cargo test --workspace --test chaos -- --ignored --nocapture --exact "chaos_$level"
