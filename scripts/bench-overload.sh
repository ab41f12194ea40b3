#!/usr/bin/env bash
# Overload: SmolLM2 under a bursty open-loop load with heavy-tailed prompt lengths,
# offered beyond what the cluster serves, the same arrivals and prompts for every run:
#   1. a 1P1D `tandem up` cluster, once per routing policy: accepted requests must complete
#      (they wait in the router's queue), and only requests past the router's bound may be
#      refused, at once;
#      With the router bounded to 32 requests (`bounded`), the rest are refused at once;
#   2. a 1P2D cluster (nodes started one by one, so that one can die) whose first decode node is
#      SIGKILLed halfway through the arrivals: its streams must resume on the other exactly;
#   3. llama-server (both cores, 16 slots of 4,096 tokens, the longest prompt's room).
# Greedy decoding makes the runs comparable request by request: every completion of every run
# must equal the first run's for the same prompt (an exact server answers the same whatever the
# batching, routing and failovers).
#
# Usage: scripts/bench-overload.sh [RATE] [REQUESTS]   (default 1.35 requests/s, 243 requests:
#   3 minutes at 1.5 times the 0.9 requests/s 1P1D serves on a 2-core machine)
# Env: TANDEM (the binary, default target/release/tandem), SEED (default 1), LLAMA_SERVER
#   (default the one ../shared/tools/build-llamacpp.sh builds), RUNS (default
#   "affinity round-robin bounded 1p2d-kill llama-server": a subset reruns those alone, and the
#   exactness check then compares with the last affinity run of the same load).
# Load: `tandem-bench serve --rate RATE --burstiness 0.25 --prompt-words 230 --prompt-sigma 1
#   --max-tokens 64 --max-inflight 1024`.
# Results: target/bench-overload/<run>.json, a line per run on stdout (completed, failures by
#   code and how fast they came, achieved rate, TTFT and ITL p50/p99), then the exactness check.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-1.35}
requests=${2:-243}
seed=${SEED:-1}
source scripts/lib/cluster.sh
out=target/bench-overload
mkdir -p "$out"
load=(--rate "$rate" --burstiness 0.25 --prompt-words 230 --prompt-sigma 1 --max-tokens 64
  --requests "$requests" --seed "$seed" --max-inflight 1024 --warmup 2)
pids=()
cleanup() {
  [ -z "${up_pid:-}" ] || down 2>/dev/null || true
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

report() { # report NAME: one line from target/bench-overload/NAME.json
  python3 - "$out/$1.json" "$1" <<'PY'
import json, sys
l = json.load(open(sys.argv[1]))["levels"][0]
failed = sum(l["failed"].values())
fast = f', failures came after p50/p99 {l["failed_ms"]["p50"]:.0f}/{l["failed_ms"]["p99"]:.0f} ms ({l.get("failed_example")})' if failed else ''
print(f'{sys.argv[2]}: {l["completed"]}/{l["requests"]} completed, failed {l["failed"]}{fast}, '
      f'{l["request_throughput"]:.2f} req/s served of {l["value"]} offered, '
      f'TTFT p50/p99 {l["ttft_ms"]["p50"]:.0f}/{l["ttft_ms"]["p99"]:.0f} ms, '
      f'ITL p50/p99 {l["itl_ms"]["p50"]:.1f}/{l["itl_ms"]["p99"]:.1f} ms, '
      f'{l["duration_s"]:.0f} s')
PY
}

todo=${RUNS:-affinity round-robin bounded 1p2d-kill llama-server}
wants() { [[ " $todo " == *" $1 "* ]]; }
for policy in affinity round-robin; do
  wants "$policy" || continue
  up "$out/up-$policy.log" --prefill 1 --decode 1 --policy "$policy"
  "$bench" serve --server "$up_addr" "${load[@]}" --label "tandem-$policy" \
    --out "$out/$policy.json" >"$out/$policy.txt"
  down
  report "$policy"
done
# The same with the router holding at most 32 requests (running and queued): the rest must be
# refused at once.
if wants bounded; then
  TANDEM_MAX_INFLIGHT=32 up "$out/up-bounded.log" --prefill 1 --decode 1
  "$bench" serve --server "$up_addr" "${load[@]}" --label tandem-bounded \
    --out "$out/bounded.json" >"$out/bounded.txt"
  down
  report bounded
fi

# node LOG ROLE [FLAG...]: starts one node on a free port; sets $node_pid and $node_addr.
node() {
  local log=$1
  shift
  "$tandem" "$@" --listen 127.0.0.1:0 >"$log" 2>&1 &
  node_pid=$!
  pids+=("$node_pid")
  for _ in $(seq 1 240); do grep -q "^listening on " "$log" && break; sleep 0.5; done
  node_addr=$(grep -m1 "^listening on " "$log" | awk '{print $NF}')
  [ -n "$node_addr" ] || { echo "$* did not start; see $log" >&2; return 1; }
}
if wants 1p2d-kill; then
worker=(--model smollm2 --threads 1)
node "$out/kill-prefill.log" prefill "${worker[@]}"
p=$node_addr
node "$out/kill-decode-0.log" decode "${worker[@]}"
d0=$node_addr
victim=$node_pid
node "$out/kill-decode-1.log" decode "${worker[@]}"
d1=$node_addr
node "$out/kill-router.log" router --http-listen off --prefill "$p" --decode "$d0,$d1"
router=$node_addr
for _ in $(seq 1 120); do
  "$tandem" healthcheck --addr "$router" --service tandem.v1.Generation >/dev/null 2>&1 && break
  sleep 0.5
done
half=$(python3 -c "print($requests / $rate / 2)")
( sleep "$half"; kill -KILL "$victim"; echo "SIGKILLed decode-0 ($d0) after ${half} s" >&2 ) &
"$bench" serve --server "$router" "${load[@]}" --label "tandem-1p2d-kill" \
  --out "$out/1p2d-kill.json" >"$out/1p2d-kill.txt"
grep -c "attempt failed; resuming" "$out/kill-router.log" | sed 's/^/failovers in the router log: /'
report 1p2d-kill
cleanup
pids=()
fi

if wants llama-server; then
  llama=${LLAMA_SERVER:-$HOME/.cache/tandem-peer/build/bin/llama-server}
  gguf=${GGUF:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}
  [ -x "$llama" ] || { echo "no llama-server at $llama (run ../shared/tools/build-llamacpp.sh)" >&2; exit 1; }
  "$llama" -m "$gguf" -t 2 --parallel 16 -c 65536 --port 8093 >"$out/llama-server.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do curl -sf 127.0.0.1:8093/health >/dev/null && break; sleep 0.1; done
  "$bench" serve --openai http://127.0.0.1:8093/v1 "${load[@]}" --label llama-server \
    --out "$out/llama-server.json" >"$out/llama-server.txt"
  report llama-server
fi

# Exactness: Tandem's runs against the affinity run, request by request.
python3 - "$out" affinity round-robin bounded 1p2d-kill <<'PY'
import json, os, sys
out, runs = sys.argv[1], [r for r in sys.argv[2:] if os.path.exists(f"{sys.argv[1]}/{r}.json")]
texts = {r: json.load(open(f"{out}/{r}.json"))["levels"][0]["texts"] for r in runs}
ref = texts[runs[0]]
for r in runs[1:]:
    both = [(a, b) for a, b in zip(ref, texts[r]) if a is not None and b is not None]
    same = sum(a == b for a, b in both)
    print(f"{r} against {runs[0]}: {same} of {len(both)} completions both runs have are identical")
PY
