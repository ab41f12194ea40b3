#!/usr/bin/env bash
# The simulator against the real thing: `tandem up` (one prefill and one decode node) on the
# model, then the same cluster with `--simulate`, driven by the same `tandem-bench serve` load
# on the same prompts, alternated round by round, ROUNDS times. Each round first measures the
# model's timing profile on this machine (`tandem-bench profile --threads 1`, as `tandem up`
# gives each of its two workers one thread of two cores), since a small machine's speed drifts
# by a third within an hour; $PROFILE (a file) is used instead when set. Prints, per load level, the medians over the rounds of TTFT p50 and
# ITL p50 for both and their ratio, and fails if a ratio is outside 0.8-1.2. Speculative
# decoding is off in both (a simulated reply has nothing of its prompt to copy).
#
# Usage: scripts/bench-sim.sh [ROUNDS] [extra `tandem-bench serve` flags...]
#   (default 3 rounds; default load --concurrency 1,4 --requests 24 --prompt-words 300
#   --max-tokens 48)
# Env: TANDEM, TANDEM_BENCH (default target/release/, built if missing), MODEL (a catalog name,
#   default `default`), PROFILE (a profile file instead of the shipped one).
# Results: target/bench-sim/{real,sim}.<round>.json and profile.<round>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
. scripts/lib/cluster.sh
model=${MODEL:-default}
"$tandem" model fetch "$model" >/dev/null
out=target/bench-sim
mkdir -p "$out"
load=(--concurrency 1,4 --requests 24 --prompt-words 300 --max-tokens 48)
[ $# -gt 0 ] && load=("$@")

run() { # run LABEL ROUND [FLAG...]: one cluster, one serve run
  local label=$1 round=$2
  shift 2
  "$tandem" up --model "$model" --port 0 --http-port 0 --kv-spill-temporary --speculate off \
    "$@" >"$out/up.log" 2>"$out/up.err" &
  local pid=$!
  for _ in $(seq 1 240); do
    grep -q "router (gRPC" "$out/up.log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  local addr
  addr=$(grep "router (gRPC" "$out/up.log" | awk '{print $NF}')
  [ -n "$addr" ] || { echo "tandem up did not start; see $out/up.log and up.err" >&2; kill "$pid" 2>/dev/null; return 1; }
  "$bench" serve --server "$addr" "${load[@]}" --seed "$round" --label "$label" \
    --out "$out/$label.$round.json" >/dev/null
  kill -TERM "$pid"
  wait "$pid" || true
}

for r in $(seq "$rounds"); do
  echo "== round $r of $rounds" >&2
  profile=${PROFILE:-$out/profile.$r.json}
  [ -n "${PROFILE:-}" ] || "$bench" profile --model "$model" --threads 1 --runs 2 --steps 16 \
    --out "$profile" 2>/dev/null
  run real "$r"
  run sim "$r" --simulate "$profile"
done

python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = {s: [json.load(open(f"{out}/{s}.{r}.json")) for r in range(1, rounds + 1)] for s in ("real", "sim")}
bad = []
print("| load | TTFT p50 real / sim (ms) | ratio | ITL p50 real / sim (ms) | ratio |")
print("|---|---|---|---|---|")
for i, level in enumerate(runs["real"][0]["levels"]):
    m = lambda s, f: statistics.median(f(run["levels"][i]) for run in runs[s])
    ttft = [m(s, lambda l: l["ttft_ms"]["p50"]) for s in ("real", "sim")]
    itl = [m(s, lambda l: l["itl_ms"]["p50"]) for s in ("real", "sim")]
    ratios = (ttft[1] / ttft[0], itl[1] / itl[0])
    name = f"{level['mode']} {level['value']:g}"
    print(f"| {name} | {ttft[0]:.0f} / {ttft[1]:.0f} | {ratios[0]:.2f} | {itl[0]:.1f} / {itl[1]:.1f} | {ratios[1]:.2f} |")
    bad += [f"{name}: {what} ratio {r:.2f}" for what, r in zip(("TTFT", "ITL"), ratios) if not 0.8 <= r <= 1.2]
if bad:
    sys.exit("the simulation is off by more than 20%: " + "; ".join(bad))
EOF
