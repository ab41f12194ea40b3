#!/usr/bin/env bash
# The agent benchmark: `tandem-bench agent` (coding-agent sessions, identical prompts on every
# system) against each system, back to back on this machine, on the default model (the 0.5B
# Qwen2.5-Coder), for each API ROUNDS times:
#   tandem-1p1d   tandem up                          (one prefill and one decode node)
#   tandem-2p2d   tandem up --prefill 2 --decode 2
#   llama-server  llama-server -t 2 --parallel 2, its prompt cache on (if LLAMA_SERVER is set,
#                 or ../shared/tools/build-llamacpp.sh has built it)
# Each system starts fresh (empty caches) for each round and API. Results go to
# target/bench-agent/ as JSON, one file per API, system and round; the script prints a table of
# the medians and plots the last round's TTFT by turn (target/bench-agent/plots/).
#
# Usage: scripts/bench-agent.sh [ROUNDS] [extra `tandem-bench agent` flags...]
# Env: TANDEM (the binary, default target/release/tandem), LLAMA_SERVER, GGUF, APIS (default
# "messages responses").
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
gguf=${GGUF:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
llama=${LLAMA_SERVER:-$HOME/.cache/tandem-peer/build/bin/llama-server}
out=target/bench-agent
mkdir -p "$out"
port=50081
http_port=8181
lport=8191
model=default
flags=("$@")

. scripts/lib/up.sh
trap stop EXIT

for r in $(seq "$rounds"); do
  for api in ${APIS:-messages responses}; do
    echo "== round $r of $rounds, $api" >&2
    up
    "$bench" agent --openai "http://127.0.0.1:$http_port" --api "$api" "${flags[@]}" --label tandem-1p1d --json >"$out/$api.tandem-1p1d.$r.json"
    stop
    up --prefill 2 --decode 2
    "$bench" agent --openai "http://127.0.0.1:$http_port" --api "$api" "${flags[@]}" --label tandem-2p2d --json >"$out/$api.tandem-2p2d.$r.json"
    stop
    if [ -x "$llama" ]; then
      "$llama" -m "$gguf" -t 2 --parallel 2 -c 32768 --jinja --port "$lport" >"$out/llama-server.log" 2>&1 &
      pid=$!
      for _ in $(seq 600); do curl -sf "127.0.0.1:$lport/health" >/dev/null && break; sleep 0.1; done
      "$bench" agent --openai "http://127.0.0.1:$lport" --api "$api" "${flags[@]}" --label llama-server --json >"$out/$api.llama-server.$r.json" \
        || { echo "llama-server $api round $r failed (see $out/llama-server.log)" >&2; rm -f "$out/$api.llama-server.$r.json"; }
      stop
    fi
  done
done

for api in ${APIS:-messages responses}; do
  "$bench" plot $(for s in tandem-1p1d tandem-2p2d llama-server; do
    [ -f "$out/$api.$s.$rounds.json" ] && echo "$out/$api.$s.$rounds.json"; done) --out "$out/plots/$api" >/dev/null
done

python3 - "$out" "$rounds" "${APIS:-messages responses}" <<'PY'
import json, statistics, sys, os
out, rounds, apis = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
cpu = open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()
print(f"medians over {rounds} rounds (CPU: {cpu})")
print("| API | system | last-turn prompt tokens | first-turn TTFT ms | follow-up TTFT ms (p50 / p90) | follow-up prompt tokens from a cache |")
print("|---|---|---|---|---|---|")
for api in apis:
    for system in ["tandem-1p1d", "tandem-2p2d", "llama-server"]:
        runs = [json.load(open(f"{out}/{api}.{system}.{r}.json"))["summary"] for r in range(1, rounds + 1) if os.path.exists(f"{out}/{api}.{system}.{r}.json")]
        if not runs:
            continue
        m = lambda k: statistics.median(x[k] for x in runs)
        print(f"| {api} | {system} | {m('last_turn_prompt_tokens_mean'):.0f} | {m('first_turn_ttft_ms_median'):.0f} | "
              f"{m('follow_up_ttft_ms_median'):.0f} / {m('follow_up_ttft_ms_p90'):.0f} | {100*m('follow_up_cached_share'):.1f}% |")
PY
