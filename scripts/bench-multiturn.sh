#!/usr/bin/env bash
# The multi-turn benchmark of prefix caching and affinity routing, every system on the same
# conversations, back to back on this machine, ROUNDS times:
#   caches-off   tandem up --prefill 2 --decode 2 --prefix-cache off   (the cold baseline)
#   affinity     tandem up --prefill 2 --decode 2                      (the default)
#   round-robin  tandem up --prefill 2 --decode 2 --policy round-robin
#   llama-server llama-server --parallel 4 with prompt caching (if LLAMA_SERVER is set, or
#                ../shared/tools/build-llamacpp.sh has built it)
# Each system starts fresh (empty caches) for each round. Results go to target/bench-multiturn/
# as JSON, one file per system and round, and the script prints a table of the medians and
# plots the last round's TTFT by turn (target/bench-multiturn/plots/multiturn_ttft.png).
#
# Usage: scripts/bench-multiturn.sh [ROUNDS] [extra `tandem-bench multiturn` flags...]
# Env: TANDEM (the binary, default target/release/tandem), LLAMA_SERVER, GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
gguf=${GGUF:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}
llama=${LLAMA_SERVER:-$HOME/.cache/tandem-peer/build/bin/llama-server}
out=target/bench-multiturn
mkdir -p "$out"
port=50071
lport=8091
flags=("$@")

. scripts/lib/up.sh
trap stop EXIT

for r in $(seq "$rounds"); do
  echo "== round $r of $rounds" >&2
  up --prefill 2 --decode 2 --prefix-cache off
  "$bench" multiturn --server "127.0.0.1:$port" "${flags[@]}" --label caches-off --json >"$out/caches-off.$r.json"
  stop
  cold="$out/caches-off.$r.json"
  up --prefill 2 --decode 2
  "$bench" multiturn --server "127.0.0.1:$port" "${flags[@]}" --label affinity --cold "$cold" --json >"$out/affinity.$r.json"
  stop
  up --prefill 2 --decode 2 --policy round-robin
  "$bench" multiturn --server "127.0.0.1:$port" "${flags[@]}" --label round-robin --cold "$cold" --json >"$out/round-robin.$r.json"
  stop
  if [ -x "$llama" ]; then
    "$llama" -m "$gguf" -t 2 --parallel 4 -c 32768 --port "$lport" >"$out/llama-server.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do curl -sf "127.0.0.1:$lport/health" >/dev/null && break; sleep 0.1; done
    "$bench" multiturn --openai "http://127.0.0.1:$lport" "${flags[@]}" --label llama-server --cold "$cold" --json >"$out/llama-server.$r.json" \
      || { echo "llama-server round $r failed (see $out/llama-server.log)" >&2; rm -f "$out/llama-server.$r.json"; }
    stop
  fi
done

# Per-turn TTFT of the last round, every system on one plot.
"$bench" plot $(for s in caches-off affinity round-robin llama-server; do
  [ -f "$out/$s.$rounds.json" ] && echo "$out/$s.$rounds.json"; done) --out "$out/plots" >/dev/null

python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys, os
out, rounds = sys.argv[1], int(sys.argv[2])
print(f"medians over {rounds} rounds (CPU: {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()})")
print("| system | last-turn prompt tokens | first-turn TTFT ms | follow-up TTFT ms (p50 / p90) | follow-up / caches-off TTFT | on their prefix | decode max/mean | prefill max/mean | local prefills |")
print("|---|---|---|---|---|---|---|---|---|")
for system in ["caches-off", "affinity", "round-robin", "llama-server"]:
    runs = [json.load(open(f"{out}/{system}.{r}.json"))["summary"] for r in range(1, rounds + 1) if os.path.exists(f"{out}/{system}.{r}.json")]
    if not runs:
        continue
    m = lambda k: statistics.median(x[k] for x in runs if x.get(k) is not None) if any(x.get(k) is not None for x in runs) else float("nan")
    print(f"| {system} | {m('last_turn_prompt_tokens_mean'):.0f} | {m('first_turn_ttft_ms_median'):.0f} | "
          f"{m('follow_up_ttft_ms_median'):.0f} / {m('follow_up_ttft_ms_p90'):.0f} | "
          f"{m('follow_up_ttft_ratio_to_cold_median'):.3f} | {100*m('follow_ups_on_their_prefix'):.1f}% | "
          f"{m('decode_max_over_mean'):.2f} | {m('prefill_max_over_mean'):.2f} | {m('local_prefills'):.0f} |")
EOF
