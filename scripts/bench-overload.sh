#!/usr/bin/env bash
# Overload: a 1P1D `tandem up` cluster on the default model under a bursty open-loop load with
# heavy-tailed prompt lengths, once per routing policy. Offered beyond what the cluster serves,
# accepted requests must still complete (they wait in the router's queue), and only requests
# past the router's bound may be refused, at once.
#
# Usage: scripts/bench-overload.sh [RATE] [REQUESTS]   (default 1.5 requests/s, 150 requests)
# Env: TANDEM (the binary, default target/release/tandem), SEED (default 1).
# Load: `tandem bench serve --rate RATE --burstiness 0.25 --prompt-words 230 --prompt-sigma 1
#   --max-tokens 64`, the same arrivals and prompts for every policy.
# Results: target/bench-overload/<policy>.json and a line per policy on stdout: completed,
#   failures by code, achieved request rate, TTFT and ITL p50/p99.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-1.5}
requests=${2:-150}
seed=${SEED:-1}
source scripts/lib/cluster.sh
out=target/bench-overload
mkdir -p "$out"
trap 'down 2>/dev/null || true' EXIT
for policy in affinity round-robin; do
  up "$out/up-$policy.log" --prefill 1 --decode 1 --policy "$policy"
  "$tandem" bench serve --server "$up_addr" --rate "$rate" --burstiness 0.25 \
    --prompt-words 230 --prompt-sigma 1 --max-tokens 64 --requests "$requests" --seed "$seed" \
    --warmup 2 --label "tandem-$policy" --out "$out/$policy.json" >"$out/$policy.txt"
  down
  python3 - "$out/$policy.json" "$policy" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
l = r["levels"][0]
print(f'{sys.argv[2]}: {l["completed"]}/{l["requests"]} completed, failed {l["failed"]}, '
      f'{l["request_throughput"]:.2f} req/s served of {l["value"]} offered, '
      f'TTFT p50/p99 {l["ttft_ms"]["p50"]:.0f}/{l["ttft_ms"]["p99"]:.0f} ms, '
      f'ITL p50/p99 {l["itl_ms"]["p50"]:.1f}/{l["itl_ms"]["p99"]:.1f} ms, '
      f'{l["duration_s"]:.0f} s')
EOF
done
