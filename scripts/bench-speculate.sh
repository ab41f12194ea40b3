#!/usr/bin/env bash
# Speculative decoding through the cluster (docs/speculative.md): `tandem up` (one prefill and
# one decode node, SmolLM2) with --speculate off, then on, alternated round by round on
# this machine, ROUNDS times. Each cluster serves, one at a time, the prompts of
# bench/src/speculate-prompts.jsonl (greedy, 256 tokens at most, through `tandem generate
# --server`: single-stream decode tokens/s from the reply's timings), then `tandem-bench serve` at
# 16 concurrent clients (aggregate output tokens/s). The script checks that both modes generate
# the same tokens.
#
# Usage: scripts/bench-speculate.sh [ROUNDS]   (default 3)
# Env: TANDEM (the binary, default target/release/tandem).
# Results: target/bench-speculate/<mode>.<round>.json, and a table of medians over the rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
. scripts/lib/cluster.sh
out=target/bench-speculate
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for mode in off on; do
    up "$out/up-$mode.log" --speculate "$mode"
    echo "round $round: speculation $mode at $up_addr" >&2
    python3 - "$tandem" "$up_addr" >"$out/$mode.$round.prompts.json" <<'PY'
import json, subprocess, sys
tandem, addr = sys.argv[1], sys.argv[2]
results = []
for line in open("bench/src/speculate-prompts.jsonl"):
    p = json.loads(line)
    messages = json.dumps([{"role": "user", "content": p["text"]}])
    out = subprocess.run(
        [tandem, "generate", "--server", addr, "--messages", messages, "--max-tokens", "256",
         "--json"], check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    tokens = len(r["token_ids"])
    results.append({"name": p["name"], "kind": p["kind"], "tokens": tokens,
                    "token_ids": r["token_ids"],
                    "decode_tok_s": (tokens - 1) / (r["decode_ms"] / 1e3),
                    "draft_tokens": r["draft_tokens"],
                    "accepted_draft_tokens": r["accepted_draft_tokens"]})
json.dump(results, sys.stdout)
PY
    "$bench" serve --server "$up_addr" --concurrency 16 --requests 32 --prompt-words 100 \
      --max-tokens 64 --warmup 2 --seed "$round" --label "$mode" --json \
      >"$out/$mode.$round.serve.json" 2>/dev/null
    down
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
load = lambda mode, r, what: json.load(open(f"{out}/{mode}.{r}.{what}.json"))
runs = {m: [load(m, r, "prompts") for r in range(1, rounds + 1)] for m in ["off", "on"]}
for r in range(rounds):
    for a, b in zip(runs["off"][r], runs["on"][r]):
        if a["token_ids"] != b["token_ids"]:
            print(f"MISMATCH: {a['name']} round {r + 1}: speculation changed the tokens")
print("| prompt | kind | tokens | off tok/s | on tok/s | on/off | accepted / drafted |")
print("|---|---|---|---|---|---|---|")
for i, p in enumerate(runs["off"][0]):
    med = lambda m: statistics.median(run[i]["decode_tok_s"] for run in runs[m])
    on = runs["on"][0][i]
    acc = f"{on['accepted_draft_tokens']} / {on['draft_tokens']}"
    print(f"| {p['name']} | {p['kind']} | {p['tokens']} | {med('off'):.1f} | {med('on'):.1f} "
          f"| {med('on') / med('off'):.2f} | {acc} |")
serve = {m: [load(m, r, "serve")["levels"][0] for r in range(1, rounds + 1)] for m in ["off", "on"]}
med = lambda m, f: statistics.median(f(l) for l in serve[m])
off, on = med("off", lambda l: l["output_tok_s"]), med("on", lambda l: l["output_tok_s"])
failed = sum(sum(l["failed"].values()) for m in serve for l in serve[m])
print(f"\nbench serve, 16 clients: off {off:.1f} tok/s, on {on:.1f} tok/s, on/off {on / off:.2f}; "
      f"TPOT p50 off {med('off', lambda l: l['tpot_ms']['p50']):.1f} ms, "
      f"on {med('on', lambda l: l['tpot_ms']['p50']):.1f} ms; failed {failed}")
PY
