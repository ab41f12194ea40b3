#!/usr/bin/env bash
# guidellm (vLLM's benchmark tool, from PyPI, unmodified) against Tandem's OpenAI HTTP API
# (`tandem up`, one prefill and one decode node) and llama-server (same GGUF, both cores,
# continuous batching), alternated round by round on this machine, ROUNDS times. Each run is a
# guidellm scenario: synthetic prompts of PROMPT tokens, OUTPUT tokens each (guidellm holds the
# length with `ignore_eos`), at concurrency 1 and 8, MAX_REQUESTS requests per level, streamed
# through /v1/completions with vLLM's `stream_options` (`continuous_usage_stats`).
#
# Usage: scripts/bench-guidellm.sh [ROUNDS]   (default 3)
# Env: TANDEM (default target/release/tandem), LLAMA_SERVER (default the one
#   ../shared/tools/build-llamacpp.sh builds), MODEL (a catalog name, default
#   qwen2.5-coder-0.5b; fetched first), PROMPT (256), OUTPUT (64), MAX_REQUESTS (16).
# guidellm 0.8.1 and its dependencies (torch among them, about 4 GB) go into
# target/guidellm-venv on first use; its synthetic prompts are counted with the GGUF's own
# tokenizer, converted once by transformers.
# Results: target/bench-guidellm/MODEL/<system>.<round>.json (guidellm's report) and a table of
# medians over the rounds on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release -p tandem-cli
model=${MODEL:-qwen2.5-coder-0.5b}
gguf=$("$tandem" model fetch "$model")
llama=${LLAMA_SERVER:-$HOME/.cache/tandem-peer/build/bin/llama-server}
[ -x "$llama" ] || { echo "no llama-server at $llama (run ../shared/tools/build-llamacpp.sh)" >&2; exit 1; }
out=target/bench-guidellm/$model
mkdir -p "$out"
venv=target/guidellm-venv
if [ ! -x "$venv/bin/guidellm" ]; then
  echo "installing guidellm into $venv (about 4 GB with torch)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet guidellm==0.8.1 gguf==0.19.0
fi
tokenizer=$out/tokenizer
if [ ! -f "$tokenizer/tokenizer.json" ]; then
  echo "converting $gguf's tokenizer for guidellm" >&2
  "$venv/bin/python" - "$gguf" "$tokenizer" <<'EOF'
import os, sys
from transformers import AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
EOF
fi
port=50083
hport=8083
lport=8094

. scripts/lib/peers.sh
start_peers "$gguf" "$port" "$hport" "$lport" 8

# One guidellm scenario per run; `benchmarks` are the concurrency levels.
scenario() { # TARGET ROUND REPORT
  cat <<EOF
{
  "metadata": {"name": "tandem-vs-llama-server", "description": "bench-guidellm.sh"},
  "spec": {
    "backend": {"kind": "openai_http", "target": "$1", "request_format": "/v1/completions"},
    "profile": {"kind": "concurrent"},
    "data": [{"kind": "synthetic_text", "prompt_tokens": ${PROMPT:-256}, "output_tokens": ${OUTPUT:-64}}],
    "tokenizer": {"kind": "huggingface_auto", "model": "$PWD/$tokenizer"},
    "constraints": [{"kind": "max_requests", "count": ${MAX_REQUESTS:-16}}],
    "seed": {"kind": "static", "value": $2},
    "outputs": [{"kind": "json", "path": "$PWD/$3"}]
  },
  "benchmarks": [{"profile.streams": 1}, {"profile.streams": 8}]
}
EOF
}
for r in $(seq "$rounds"); do
  for system in tandem llama-server; do
    echo "== round $r of $rounds: $system" >&2
    target=http://127.0.0.1:$hport
    [ "$system" = llama-server ] && target=http://127.0.0.1:$lport
    scenario "$target" "$r" "$out/$system.$r.json" >"$out/scenario.json"
    "$venv/bin/guidellm" run --config "$out/scenario.json" --disable-progress >"$out/$system.$r.log" 2>&1 \
      || { tail -30 "$out/$system.$r.log" >&2; exit 1; }
  done
done

"$venv/bin/python" - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("| system | concurrency | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |")
print("|---|---|---|---|---|---|---|")
for system in ["tandem", "llama-server"]:
    runs = [json.load(open(f"{out}/{system}.{r}.json"))["benchmarks"] for r in range(1, rounds + 1)]
    for i in range(len(runs[0])):
        bs = [run[i] for run in runs]
        m = lambda f: statistics.median(f(b) for b in bs)
        metric = lambda b, name, stat: b["metrics"][name]["successful"][stat]
        streams = bs[0]["config"]["strategy"]["streams"]
        errors = sum(b["metrics"]["request_totals"]["errored"] for b in bs)
        print(f"| {system} | {streams} "
              f"| {m(lambda b: metric(b, 'requests_per_second', 'mean')):.2f} "
              f"| {m(lambda b: metric(b, 'output_tokens_per_second', 'mean')):.1f} "
              f"| {m(lambda b: metric(b, 'time_to_first_token_ms', 'median')):.0f} / {m(lambda b: metric(b, 'time_to_first_token_ms', 'percentiles')['p99']):.0f} "
              f"| {m(lambda b: metric(b, 'inter_token_latency_ms', 'median')):.1f} / {m(lambda b: metric(b, 'inter_token_latency_ms', 'percentiles')['p99']):.1f} "
              f"| {errors} |")
EOF
