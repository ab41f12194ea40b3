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
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

# wait_line FILE PATTERN WHAT: waits up to 60 s for a line of FILE to match PATTERN.
wait_line() {
  for _ in $(seq 1 120); do grep -q "$2" "$1" && return 0; sleep 0.5; done
  echo "fleet: $3 did not start; see $1 and ${1%.out}.err" >&2
  return 1
}

"$tandem" sim --model "$model" --prefill "$prefill" --decode "$decode" --kv-budget-mb 64 \
  >"$dir/sim.out" 2>"$dir/sim.err" &
pids+=($!)
wait_line "$dir/sim.out" '^decode ' "tandem sim"
prefills=$(sed -n 's/^prefill //p' "$dir/sim.out")
decodes=$(sed -n 's/^decode //p' "$dir/sim.out")

"$tandem" router --prefill "$prefills" --decode "$decodes" --listen 127.0.0.1:0 \
  --http-listen off >"$dir/router.out" 2>"$dir/router.err" &
pids+=($!)
wait_line "$dir/router.out" 'listening on' "the router"
router=$(sed -n 's/^listening on //p' "$dir/router.out" | head -1)

metrics() { curl -sf "http://$router/metrics"; }
# Every replica up.
nodes=$((prefill + decode))
for _ in $(seq 1 120); do
  up=$(metrics | grep -c '^tandem_router_replica_up{.*} 1$' || true)
  [ "$up" -ge "$nodes" ] && break
  sleep 0.5
done
[ "$up" -ge "$nodes" ] || { echo "fleet: $up of $nodes replicas up; see $dir" >&2; exit 1; }

"$bench" multiturn --server "$router" --sessions "$sessions" --turns "$turns" --concurrency 16 \
  --max-tokens 16 --message-words 40 --label "fleet-$level" --json >"$dir/multiturn.json"

# Every replica's index in sync: known current within the last 5 s.
behind=$(metrics | awk '/^tandem_router_index_seconds_since_sync\{/ && $NF > 5 {n++} END {print n+0}')
[ "$behind" -eq 0 ] || { echo "fleet: $behind replicas' cache index out of sync; see $dir" >&2; exit 1; }
python3 - "$dir/multiturn.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(f"fleet smoke: {s['turns']} turns, follow-ups from a cache {s['follow_up_cached_share']:.1%}, "
      f"on their prefix {s['follow_ups_on_their_prefix']:.1%}, decode max/mean {s['decode_max_over_mean']:.2f}")
EOF
