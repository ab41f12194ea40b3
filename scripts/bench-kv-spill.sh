#!/usr/bin/env bash
# The caches' disk tier under more conversations than the KV pools hold: the same multi-turn
# workload (`tandem-bench multiturn`, 16 conversations) against, back to back on this machine,
# ROUNDS times:
#   caches-off    tandem up --prefix-cache off                      (the cold baseline)
#   pool-only     tandem up --kv-budget-mb MB                       (caches, no disk tier)
#   disk-tier     tandem up --kv-budget-mb MB --kv-spill-dir DIR    (caches and the disk tier)
#   llama-server  llama-server --parallel 4 with its prompt cache (if LLAMA_SERVER is set, or
#                 ../shared/tools/build-llamacpp.sh has built it)
# Each Tandem cluster is one prefill and one decode node, started fresh (empty caches, an empty
# spill directory) each round. MB (env POOL_MB, default 96) is each worker's KV pool: on
# SmolLM2 (23 KB of KV a token) it holds about a quarter of the conversations' histories.
# Results go to target/bench-kv-spill/ as JSON, one file per system and round; the script
# prints a table of the medians.
#
# Usage: scripts/bench-kv-spill.sh [ROUNDS] [extra `tandem-bench multiturn` flags...]
# Env: TANDEM (the binary, default target/release/tandem), LLAMA_SERVER, GGUF, POOL_MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release -p tandem-cli
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
gguf=${GGUF:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$gguf" ] || "$tandem" model fetch smollm2
llama=${LLAMA_SERVER:-$HOME/.cache/tandem-peer/build/bin/llama-server}
pool=${POOL_MB:-96}
out=target/bench-kv-spill
spill=$out/spill
mkdir -p "$out"
port=50081
lport=8093
flags=(--sessions 16 --turns 6 --max-tokens 48 --concurrency 4 "$@")

. scripts/lib/up.sh
trap 'stop; rm -rf "$spill"' EXIT
# One prefill and one decode node, plaintext between them (--insecure) so that the script can
# read their /metrics.
cluster=(--prefill 1 --decode 1 --insecure)

run() { # label, then bench flags
  local label=$1 r=$2
  shift 2
  "$bench" multiturn "$@" "${flags[@]}" --label "$label" --json >"$out/$label.$r.json"
}

for r in $(seq "$rounds"); do
  echo "== round $r of $rounds" >&2
  up "${cluster[@]}" --prefix-cache off
  run caches-off "$r" --server "127.0.0.1:$port"
  stop
  cold="$out/caches-off.$r.json"
  up "${cluster[@]}" --kv-budget-mb "$pool"
  run pool-only "$r" --server "127.0.0.1:$port" --cold "$cold"
  stop
  rm -rf "$spill"
  up "${cluster[@]}" --kv-budget-mb "$pool" --kv-spill-dir "$spill"
  run disk-tier "$r" --server "127.0.0.1:$port" --cold "$cold"
  # The tier's own figures, from the up log's node addresses.
  for addr in $(awk '$1 ~ /^(prefill|decode)-[0-9]+$/ {print $2}' "$out/up.log"); do
    curl -s "http://$addr/metrics" | grep -E '^tandem_(prefill|decode)_kv_spill_' || true
  done >"$out/disk-tier.$r.metrics"
  stop
  if [ -x "$llama" ]; then
    "$llama" -m "$gguf" -t 2 --parallel 4 -c 32768 --port "$lport" >"$out/llama-server.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do curl -sf "127.0.0.1:$lport/health" >/dev/null && break; sleep 0.1; done
    run llama-server "$r" --openai "http://127.0.0.1:$lport" --cold "$cold" \
      || { echo "llama-server round $r failed (see $out/llama-server.log)" >&2; rm -f "$out/llama-server.$r.json"; }
    stop
  fi
done

python3 - "$out" "$rounds" "$pool" <<'EOF'
import json, statistics, sys, os
out, rounds, pool = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cpu = open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()
print(f"medians over {rounds} rounds, KV pool {pool} MiB per worker (CPU: {cpu})")
print("| system | last-turn prompt tokens | follow-up prompt tokens from a cache | follow-ups on their prefix | first-turn TTFT ms | follow-up TTFT ms (p50 / p90) | follow-up / caches-off TTFT |")
print("|---|---|---|---|---|---|---|")
for system in ["caches-off", "pool-only", "disk-tier", "llama-server"]:
    runs = [json.load(open(f"{out}/{system}.{r}.json"))["summary"] for r in range(1, rounds + 1) if os.path.exists(f"{out}/{system}.{r}.json")]
    if not runs:
        continue
    m = lambda k: statistics.median(x[k] for x in runs if x.get(k) is not None) if any(x.get(k) is not None for x in runs) else float("nan")
    print(f"| {system} | {m('last_turn_prompt_tokens_mean'):.0f} | {100*m('follow_up_cached_share'):.1f}% | "
          f"{100*m('follow_ups_on_their_prefix'):.1f}% | {m('first_turn_ttft_ms_median'):.0f} | "
          f"{m('follow_up_ttft_ms_median'):.0f} / {m('follow_up_ttft_ms_p90'):.0f} | "
          f"{m('follow_up_ttft_ratio_to_cold_median'):.3f} |")
for r in range(1, rounds + 1):
    path = f"{out}/disk-tier.{r}.metrics"
    if os.path.exists(path):
        figures = dict(l.split() for l in open(path) if l.strip())
        print(f"round {r} disk tier: " + ", ".join(f"{k} {v}" for k, v in sorted(figures.items())))
EOF
