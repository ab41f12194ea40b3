#!/usr/bin/env bash
# The engine table of docs/benchmarks.md: `tandem-bench engine` against llama.cpp's `llama-bench`
# on the same GGUF file, 2 threads each, the two alternated round by round on this machine.
# Prefill is 512 tokens (llama-bench's pp512), decode 128 tokens at batch 1 (its tg128); Tandem's
# batch-16 aggregate is reported beside them.
#
# Usage: scripts/bench-engine.sh [ROUNDS] [MODEL...]
#   (default 3 rounds; models by catalog name, default qwen2.5-coder-0.5b, each fetched first,
#   or by the path of a GGUF file, e.g. the Qwen3 and Qwen3-30B-A3B shapes that
#   `scripts/make_test_models.py --bench` makes)
# Env: TANDEM (the binary, default target/release/tandem), LLAMA_BENCH (default the one
#   ../shared/tools/build-llamacpp.sh builds).
# Results: target/bench-engine/<model>.<system>.<round>.json and a table of medians on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(qwen2.5-coder-0.5b)
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release -p tandem-cli
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
llama=${LLAMA_BENCH:-$HOME/.cache/tandem-peer/build/bin/llama-bench}
[ -x "$llama" ] || { echo "no llama-bench at $llama (run ../shared/tools/build-llamacpp.sh)" >&2; exit 1; }
out=target/bench-engine
mkdir -p "$out"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)" >&2
names=()
for model in "${models[@]}"; do
  if [ -f "$model" ]; then gguf=$model; model=$(basename "$model" .gguf); else gguf=$("$tandem" model fetch "$model"); fi
  names+=("$model")
  for round in $(seq 1 "$rounds"); do
    echo "[$model round $round/$rounds] tandem" >&2
    "$bench" engine --model "$gguf" --threads 2 --runs 1 --batch 1,16 --json \
      > "$out/$model.tandem.$round.json"
    echo "[$model round $round/$rounds] llama-bench" >&2
    "$llama" -m "$gguf" -t 2 -p 512 -n 128 -r 1 -o json > "$out/$model.llama.$round.json" 2>/dev/null
  done
done
python3 - "$out" "$rounds" "${names[@]}" <<'PY'
import json, statistics, sys
out, rounds, models = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| model | llama.cpp pp512 | Tandem prefill 512 | ratio | llama.cpp tg128 | Tandem decode b1 | ratio | Tandem decode b16 | peak RSS MB |")
print("|---|---|---|---|---|---|---|---|---|")
for m in models:
    lp, lt, tp, t1, t16 = [], [], [], [], []
    for r in range(1, rounds + 1):
        for test in json.load(open(f"{out}/{m}.llama.{r}.json")):
            (lp if test["n_prompt"] > 0 else lt).append(test["avg_ts"])
        t = json.load(open(f"{out}/{m}.tandem.{r}.json"))
        kv = t["kv"][0]
        tp.append(kv["prefill_tok_s"])
        for d in kv["decode"]:
            (t1 if d["batch"] == 1 else t16).append(d["tok_s"])
    med = statistics.median
    print(f"| {m} | {med(lp):.1f} | {med(tp):.1f} | {med(tp)/med(lp):.2f}x | {med(lt):.1f} | "
          f"{med(t1):.1f} | {med(t1)/med(lt):.2f}x | {med(t16):.1f} | {t['peak_rss_mb']:.0f} |")
PY
