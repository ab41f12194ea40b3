#!/usr/bin/env bash
# One long prompt's time to first token over 1, 2 and 4 prefill nodes (docs/benchmarks.md, "One
# prompt over several prefill nodes"): for each prompt length and node count, a fresh
# `tandem up --prefill N --decode 1 --threads 1` (mutual TLS between the nodes, as `up` starts
# them; one thread per node, so the nodes share this machine's cores), then one prompt of exactly
# that many token ids (arbitrary ids, its own per run so no cache holds it) sent to the OpenAI
# HTTP API (`/v1/completions`, streamed, max_tokens 1) and timed to its first token, and with
# GRPC=1 one prompt of about as many tokens (words) sent over gRPC (`tandem-bench serve`, whose prompts
# are words). The router's debug log gives the stages' cuts, from which the KV bytes each prompt
# token sends between the stages and to the decode node follow.
#
# Usage: scripts/bench-pipeline.sh [TOKENS...]   (default 16384 32704)
# Env: NODES (default "1 2 4"), MODEL (default `default`), GRPC (1: the gRPC figure too),
#      MIN_TOKENS (the router's --pipeline-min-tokens; default the router's),
#      TANDEM, TANDEM_BENCH (the binaries). Results: target/bench-pipeline/results.jsonl and a
#      table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/cluster.sh
lengths=("$@")
[ ${#lengths[@]} -gt 0 ] || lengths=(16384 32704)
nodes=${NODES:-1 2 4}
model=${MODEL:-default}
out=target/bench-pipeline
mkdir -p "$out"
: >"$out/results.jsonl"
# A 32k-token prompt on one thread takes longer than the router's default bound (5 min) on a
# request that sets no deadline.
export TANDEM_TIMEOUT_MS=${TANDEM_TIMEOUT_MS:-7200000}
for n in "${lengths[@]}"; do
  for p in $nodes; do
    log=$out/up-$n-$p.log
    RUST_LOG=tandem_router=debug "$tandem" up --model "$model" --prefill "$p" --decode 1 \
      --threads 1 --port 0 --http-port 0 --kv-spill-temporary \
      ${MIN_TOKENS:+--pipeline-min-tokens "$MIN_TOKENS"} >"$log" 2>"$out/stderr-$n-$p.log" &
    pid=$!
    for _ in $(seq 1 240); do grep -q "(OpenAI HTTP)" "$log" && break; sleep 0.5; done
    http=$(grep -m1 "(OpenAI HTTP)" "$log" | awk '{print $NF}')
    grpc=$(grep "router (gRPC" "$log" | awk '{print $NF}')
    [ -n "$http" ] || { echo "tandem up did not start; see $log" >&2; exit 1; }
    echo "$n tokens over $p prefill node(s)" >&2
    python3 - "$http" "$n" "$p" <<'PY' >>"$out/results.jsonl"
import json, sys, time, urllib.request
base, n, nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# Arbitrary ordinary ids, a prompt of its own per run (no cache holds it).
ids = [100 + (i * 7919 + n * 31 + nodes * 7) % 50000 for i in range(n)]
body = json.dumps({"model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0,
                   "stream": True}).encode()
req = urllib.request.Request(base.rstrip("/") + "/completions", body,
                             {"content-type": "application/json"})
start = time.time()
first = None
with urllib.request.urlopen(req, timeout=7200) as r:
    for line in r:
        if line.startswith(b"data: ") and b'"text"' in line and first is None:
            first = time.time()
print(json.dumps({"api": "http", "tokens": n, "prefill_nodes": nodes,
                  "ttft_s": round(first - start, 2)}), flush=True)
PY
    if [ "${GRPC:-0}" = 1 ]; then
      # The stages' load reports come a poll after the last prompt: wait for them to be idle.
      sleep 2
      # A word of `bench serve`'s prompts is a token, and the prompt one more.
      "$bench" serve --server "$grpc" --concurrency 1 --requests 1 --warmup 0 \
        --prompt-words $((n - 1)) --max-tokens 2 --seed "$p" --json 2>/dev/null |
        python3 -c "import json,sys; l=json.load(sys.stdin)['levels'][0]; print(json.dumps({'api':'grpc','tokens':round(l['prompt_tokens_mean']),'prefill_nodes':$p,'ttft_s':round(l['ttft_ms']['p50']/1e3,2)}))" \
        >>"$out/results.jsonl"
    fi
    grep -o 'pipelined: [^"]*' "$out/stderr-$n-$p.log" | head -1 >&2 || true
    kill -TERM "$pid"
    wait "$pid" || true
  done
done
python3 - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| API | prompt tokens | prefill nodes | TTFT s | / one node |")
print("|---|---|---|---|---|")
for r in rows:
    one = next((o["ttft_s"] for o in rows if o["api"] == r["api"] and o["tokens"] == r["tokens"]
                and o["prefill_nodes"] == 1), None)
    ratio = f"{r['ttft_s'] / one:.2f}" if one else ""
    print(f"| {r['api']} | {r['tokens']} | {r['prefill_nodes']} | {r['ttft_s']} | {ratio} |")
PY
