#!/usr/bin/env bash
# The serving benchmark of docs/benchmarks.md: Tandem (`tandem up`, one prefill and one decode
# node, measured through its OpenAI HTTP API and its gRPC API) and llama-server (same GGUF, both
# cores, continuous batching), driven by the same `tandem-bench serve` load on the same prompts,
# alternated round by round on this machine, ROUNDS times. Each round uses its own prompts (seed
# = round), so no server answers from a cache what it saw before.
#
# Usage: scripts/bench-serve.sh [ROUNDS] [extra `tandem-bench serve` flags...]
#   (default 3 rounds; default load --concurrency 1,4,16 --requests 48 --max-tokens 64)
# Env: TANDEM (the binary, default target/release/tandem), LLAMA_SERVER (default the one
#   ../shared/tools/build-llamacpp.sh builds), MODEL (a catalog name, default `smollm2`; fetched
#   first) or GGUF (a file), served by both.
# Results: target/bench-serve[/MODEL]/<system>.<round>.json, a table of medians over the rounds
# on stdout, and plots of the last round in plots/ beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release -p tandem-cli
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
gguf=${GGUF:-$("$tandem" model fetch "${MODEL:-smollm2}")}
llama=${LLAMA_SERVER:-$HOME/.cache/tandem-peer/build/bin/llama-server}
[ -x "$llama" ] || { echo "no llama-server at $llama (run ../shared/tools/build-llamacpp.sh)" >&2; exit 1; }
out=target/bench-serve${MODEL:+/$MODEL}
mkdir -p "$out"
port=50081
hport=8081
lport=8092
load=(--concurrency 1,4,16 --requests 48 --max-tokens 64)
[ $# -gt 0 ] && load=("$@")

. scripts/lib/peers.sh
start_peers "$gguf" "$port" "$hport" "$lport" 16

for r in $(seq "$rounds"); do
  echo "== round $r of $rounds" >&2
  "$bench" serve --openai "http://127.0.0.1:$hport/v1" "${load[@]}" --seed "$r" \
    --label tandem --out "$out/tandem.$r.json" >/dev/null
  "$bench" serve --openai "http://127.0.0.1:$lport/v1" "${load[@]}" --seed "$r" \
    --label llama-server --out "$out/llama-server.$r.json" >/dev/null
  "$bench" serve --server "127.0.0.1:$port" "${load[@]}" --seed "$((r + 1000))" \
    --label tandem-grpc --out "$out/tandem-grpc.$r.json" >/dev/null
done
"$bench" plot "$out/tandem.$rounds.json" "$out/llama-server.$rounds.json" --out "$out/plots" >/dev/null

python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def med(xs):
    return statistics.median(xs)
print("| system | load | req/s | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | ITL p50 / p99 ms | goodput share | failed |")
print("|---|---|---|---|---|---|---|---|---|")
for system in ["tandem", "llama-server", "tandem-grpc"]:
    runs = [json.load(open(f"{out}/{system}.{r}.json")) for r in range(1, rounds + 1)]
    for i, level in enumerate(runs[0]["levels"]):
        ls = [run["levels"][i] for run in runs]
        m = lambda f: med([f(l) for l in ls])
        failed = sum(sum(l["failed"].values()) for l in ls)
        print(f"| {system} | {level['mode']} {level['value']:g} | {m(lambda l: l['request_throughput']):.2f} "
              f"| {m(lambda l: l['output_tok_s']):.0f} "
              f"| {m(lambda l: l['ttft_ms']['p50']):.0f} / {m(lambda l: l['ttft_ms']['p90']):.0f} / {m(lambda l: l['ttft_ms']['p99']):.0f} "
              f"| {m(lambda l: l['tpot_ms']['p50']):.1f} / {m(lambda l: l['tpot_ms']['p90']):.1f} "
              f"| {m(lambda l: l['itl_ms']['p50']):.1f} / {m(lambda l: l['itl_ms']['p99']):.1f} "
              f"| {m(lambda l: l['goodput_share']) * 100:.0f}% | {failed} |")
EOF
