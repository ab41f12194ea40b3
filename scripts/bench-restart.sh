#!/usr/bin/env bash
# The disk tier across a restart (issue 58): Claude Code's first turn on a cluster started cold,
# against its first turn after that cluster is stopped and started again on the same kept disk
# tier (`tandem up`'s default). Per round: `tandem up --model default --kv-spill-dir DIR
# --kv-spill-clear` (cold), one Claude Code turn (scripts/bench-claude-code.sh), SIGTERM (the
# workers write their caches out), `tandem up` again on DIR, one more turn. Prints each turn's
# JSON line and, at the end, the median TTFTs and their ratio. Every turn runs Claude Code in
# one working directory, as a user who opens the same project again would: its system prompt
# names the directory, so a fresh one per turn would make every prompt a new one.
#
# Usage: scripts/bench-restart.sh [ROUNDS] [TANDEM_BINARY]   (default 3, target/release/tandem)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
tandem=$(realpath "${2:-target/release/tandem}")
model=default
# shellcheck source=scripts/lib/up.sh
source scripts/lib/up.sh
scratch
tier="$out/kv"
export CLAUDE_WORKDIR="$out/project"
for round in $(seq "$rounds"); do
  up --kv-spill-dir "$tier" --kv-spill-clear
  scripts/bench-claude-code.sh "http://127.0.0.1:$http_port" "cold-$round" | grep "\"turn\": 1," | tee -a "$out/turns"
  stop
  up --kv-spill-dir "$tier"
  scripts/bench-claude-code.sh "http://127.0.0.1:$http_port" "restarted-$round" | grep "\"turn\": 1," | tee -a "$out/turns"
  stop
done
python3 - "$out/turns" <<'PY'
import json, statistics, sys
turns = [json.loads(l) for l in open(sys.argv[1])]
ttft = lambda kind: statistics.median(t["ttft_seconds"] for t in turns if t["label"].startswith(kind))
cold, warm = ttft("cold"), ttft("restarted")
print(json.dumps({"cold_ttft_s": cold, "restarted_ttft_s": warm, "ratio": round(warm / cold, 3)}))
PY
