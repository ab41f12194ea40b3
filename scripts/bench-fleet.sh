#!/usr/bin/env bash
# The router in front of a simulated fleet (`tandem sim`), at several sizes: what it costs the
# router per request as the fleet grows. At each size (a quarter of the nodes prefill, the rest
# decode) it runs coding-agent sessions through the Messages API (`tandem-bench agent`: a shared
# system prompt of --system-words, a tool call and its result appended each turn), then plain
# multi-turn chat over gRPC (`tandem-bench multiturn`), and reads the router's metrics around
# each: its CPU seconds per request beyond its idle rate (`process_cpu_seconds_total`), the p50
# and p99 of its work before routing (`tandem_router_prepare_seconds`) and of a routing decision
# (`tandem_router_route_seconds`), its CPU per second while idle (the health watches and load
# reports of every node), the follow-up prompt tokens served from a cache (also as a share of what caches of
# unbounded size would serve), and the decode load's max/mean.
#
# The nodes simulate a GPU-like worker (a pass of 1-16 rows 10-12 ms, 256 rows 50 ms), so that
# an 11k-token prompt takes seconds, not the minutes a CPU node takes: the router's work does not
# depend on the workers' speed, and the benchmark measures the router.
#
# Usage: scripts/bench-fleet.sh [SIZE...]   (default 16 64 256)
# Env: TANDEM, TANDEM_BENCH (default target/release/, built if missing), MODEL (default
#   `default`), SESSIONS (agent sessions, default 16), TURNS (default 6), SYSTEM_WORDS (default
#   8000, about 11k tokens with the tools).
# Results: target/bench-fleet/<size>/*.json and a table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(16 64 256)
. scripts/lib/cluster.sh
model=${MODEL:-default}
"$tandem" model fetch "$model" >/dev/null
out=target/bench-fleet
mkdir -p "$out"
profile=$out/gpu-like.json
cat >"$profile" <<'EOF'
{"model": "gpu-like", "cpu": "none: a made-up fast worker", "threads": 1,
 "passes": [[1, 0.010], [16, 0.012], [256, 0.050]], "attend_s": 1e-8}
EOF
. scripts/lib/fleet.sh

for n in "${sizes[@]}"; do
  dir=$out/$n
  mkdir -p "$dir"
  prefill=$((n / 4))
  decode=$((n - prefill))
  echo "== $n simulated nodes ($prefill prefill, $decode decode)" >&2
  start_fleet "$dir" "$prefill" "$decode" --simulate "$profile" --kv-budget-mb 256
  router_metrics >"$dir/m0.txt"
  sleep 10
  router_metrics >"$dir/m1.txt"
  "$bench" agent --openai "http://$http" --sessions "${SESSIONS:-16}" --turns "${TURNS:-6}" \
    --concurrency 8 --system-words "${SYSTEM_WORDS:-8000}" --max-tokens 16 --label "fleet-$n" \
    --json >"$dir/agent.json"
  router_metrics >"$dir/m2.txt"
  "$bench" multiturn --server "$grpc" --sessions 64 --turns 4 --concurrency 16 --max-tokens 16 \
    --label "fleet-$n" --json >"$dir/chat.json"
  router_metrics >"$dir/m3.txt"
  stop_fleet
done

python3 - "$out" "${sizes[@]}" <<'EOF'
import json, re, sys
out, sizes = sys.argv[1], sys.argv[2:]

def metrics(path):
    m = {}
    for line in open(path):
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            m[name] = float(value)
        except ValueError:
            pass
    return m

def cpu(m):
    return m.get("process_cpu_seconds_total", 0.0)

def quantiles(a, b, name):
    """p50 and p99 (upper bucket bounds, in µs) of histogram `name` between scrapes a and b."""
    buckets = []
    for k, v in b.items():
        g = re.fullmatch(name + r'_bucket\{le="([^"]+)"\}', k)
        if g:
            le = float("inf") if g.group(1) == "+Inf" else float(g.group(1))
            buckets.append((le, v - a.get(k, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    def q(p):
        for le, c in buckets:
            if total and c >= p * total:
                return le * 1e6
        return float("nan")
    return q(0.5), q(0.99), total

print("| nodes | router idle CPU | agent turns | router CPU per agent turn | prepare p50 / p99 (agent) | chat requests | router CPU per chat request | prepare p50 / p99 (chat) | route p50 / p99 | follow-ups from a cache (agent / chat) | of an unbounded cache's (agent / chat) | decode max/mean (chat) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for n in sizes:
    d = f"{out}/{n}"
    m0, m1, m2, m3 = (metrics(f"{d}/m{i}.txt") for i in range(4))
    agent, chat = json.load(open(f"{d}/agent.json")), json.load(open(f"{d}/chat.json"))
    idle = (cpu(m1) - cpu(m0)) / 10.0
    a_n, c_n = len(agent["turns"]), len(chat["turns"])
    # What the router spent beyond its idle rate, over each phase's span, per request.
    span = lambda r: max(t["sent_ms"] + t["total_ms"] for t in r["turns"]) / 1000
    a_cpu = (cpu(m2) - cpu(m1) - idle * span(agent)) / a_n
    c_cpu = (cpu(m3) - cpu(m2) - idle * span(chat)) / c_n
    pa = quantiles(m1, m2, "tandem_router_prepare_seconds")
    pc = quantiles(m2, m3, "tandem_router_prepare_seconds")
    route = quantiles(m1, m3, "tandem_router_route_seconds")
    print(f"| {n} | {idle * 1000:.0f} ms/s | {a_n} | {a_cpu * 1000:.1f} ms | {pa[0]:.0f} / {pa[1]:.0f} µs "
          f"| {c_n} | {c_cpu * 1000:.1f} ms | {pc[0]:.0f} / {pc[1]:.0f} µs | {route[0]:.0f} / {route[1]:.0f} µs "
          f"| {agent['summary']['follow_up_cached_share']:.1%} / {chat['summary']['follow_up_cached_share']:.1%} "
          f"| {agent['summary']['follow_up_cached_over_oracle']:.1%} / {chat['summary']['follow_up_cached_over_oracle']:.1%} "
          f"| {chat['summary']['decode_max_over_mean']:.2f} |")
EOF
