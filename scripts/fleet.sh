#!/usr/bin/env bash
# Simulated workers at scale (`tandem sim`, the real nodes with the model's compute replaced by
# its shipped timing profile) behind a real router, driven by multi-turn chat
# (`tandem-bench multiturn`). Fails on a lost stream (any failed turn), on a replica the router
# never sees up, or on a cache index that is not in sync at the end.
#
# Usage: scripts/fleet.sh smoke
#   16 prefill and 48 decode nodes, 32 conversations of 4 turns (CI runs this; about 30 s).
# Env: TANDEM, TANDEM_BENCH (the binaries; default target/debug/, which the test build made),
#      FLEET_MODEL (default smollm2), FLEET_DIR (logs and results; default target/fleet).
set -euo pipefail
cd "$(dirname "$0")/.."
level=${1:-smoke}
case "$level" in
  smoke) prefill=16 decode=48 sessions=32 turns=4 ;;
  *) echo "usage: $0 smoke" >&2; exit 2 ;;
esac
tandem=${TANDEM:-target/debug/tandem}
bench=${TANDEM_BENCH:-target/debug/tandem-bench}
model=${FLEET_MODEL:-smollm2}
dir=${FLEET_DIR:-target/fleet}
mkdir -p "$dir"
. scripts/lib/fleet.sh
start_fleet "$dir" "$prefill" "$decode" --kv-budget-mb 64

"$bench" multiturn --server "$grpc" --sessions "$sessions" --turns "$turns" --concurrency 16 \
  --max-tokens 16 --message-words 40 --label "fleet-$level" --json >"$dir/multiturn.json"

# Every replica's index in sync: known current within the last 5 s.
behind=$(router_metrics | awk '/^tandem_router_index_seconds_since_sync\{/ && $NF > 5 {n++} END {print n+0}')
[ "$behind" -eq 0 ] || { echo "fleet: $behind replicas' cache index out of sync; see $dir" >&2; exit 1; }
python3 - "$dir/multiturn.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(f"fleet smoke: {s['turns']} turns, follow-ups from a cache {s['follow_up_cached_share']:.1%}, "
      f"on their prefix {s['follow_ups_on_their_prefix']:.1%}, decode max/mean {s['decode_max_over_mean']:.2f}")
EOF
