#!/usr/bin/env bash
# What mutual TLS between the nodes costs (docs/benchmarks.md): `tandem up` (one prefill and one
# decode node, SmolLM2) with TLS, then with --insecure, each driven by the same
# `tandem-bench serve` over gRPC, alternated round by round on this machine, ROUNDS times. Each
# round uses its own prompts (seed = round) and fresh clusters, so no cache holds them.
#
# Usage: scripts/bench-tls.sh [ROUNDS]   (default 3)
# Env: TANDEM (the binary, default target/release/tandem).
# Results: target/bench-tls/<mode>.<round>.json, and a table of medians over the rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
. scripts/lib/cluster.sh
out=target/bench-tls
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for mode in tls insecure; do
    flags=()
    [ "$mode" = insecure ] && flags=(--insecure)
    up "$out/up-$mode.log" "${flags[@]}"
    echo "round $round: $mode at $up_addr" >&2
    "$bench" serve --server "$up_addr" --concurrency 1,4 --requests 24 --prompt-words 100 \
      --max-tokens 64 --warmup 2 --seed "$round" --label "$mode" --json \
      >"$out/$mode.$round.json" 2>/dev/null
    down
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("| nodes | clients | output tok/s | TTFT p50 ms | TPOT p50 ms | KV transfer p50 ms | failed |")
print("|---|---|---|---|---|---|---|")
for mode in ["tls", "insecure"]:
    runs = [json.load(open(f"{out}/{mode}.{r}.json")) for r in range(1, rounds + 1)]
    for i, level in enumerate(runs[0]["levels"]):
        med = lambda f: statistics.median(f(run["levels"][i]) for run in runs)
        failed = sum(sum(run["levels"][i]["failed"].values()) for run in runs)
        print(f"| {mode} | {level['value']:.0f} | {med(lambda l: l['output_tok_s']):.1f} "
              f"| {med(lambda l: l['ttft_ms']['p50']):.0f} | {med(lambda l: l['tpot_ms']['p50']):.1f} "
              f"| {med(lambda l: l['tandem']['transfer_ms']):.1f} | {failed} |")
PY
