#!/usr/bin/env bash
# The long-context table of docs/benchmarks.md: on the default model with 2 threads, the prefill
# of a whole N-token prompt and 64 decode steps at depth N, for each N, by Tandem, llama.cpp
# (flash attention on) and, when IK_LLAMA_BENCH names its llama-bench, ik_llama.cpp (flash
# attention and its run-time repacking on), one after the other in each round:
#   Tandem:       tandem-bench engine --prompt-tokens N --context-tokens N --batch 1 --gen-tokens 64
#   llama.cpp:    llama-bench -fa 1 -p N -n 0   and   llama-bench -fa 1 -p 0 -n 64 -d N
#   ik_llama.cpp: llama-bench -fa 1 -rtr 1 -p N -n 0   and   llama-bench -fa 1 -rtr 1 -gp N,64
# Each measures one run per round (a 32k prompt takes minutes); llama.cpp's warm-up, a whole
# prompt, is skipped (--no-warmup), as Tandem's and ik's warm up on a short one.
#
# Usage: scripts/bench-long-context.sh [ROUNDS] [LENGTHS]   (default 1 round; 4096,16384,32704: the
#   last with its 64 decode steps fills the model's 32,768-token context)
# Env: TANDEM (default target/release/tandem), LLAMA_BENCH (default the one
#   ../shared/tools/build-llamacpp.sh builds), IK_LLAMA_BENCH (unset: ik_llama.cpp is skipped;
#   build it from github.com/ikawrakow/ik_llama.cpp with `cmake -B build -DGGML_NATIVE=ON
#   -DLLAMA_CURL=OFF && cmake --build build --target llama-bench`: its build with AVX-512 chosen
#   flag by flag, as build-llamacpp.sh does for llama.cpp, does not compile as of 8337e4c).
#   TANDEM_MAX_CPU_ISA=avx2 runs Tandem's AVX2 paths on an AVX-512 machine (docs/operations.md);
#   measure them against peers built for AVX2 alone (-DGGML_NATIVE=OFF -DGGML_AVX2=ON ...).
# Results: target/bench-long-context/<N>.<system>.<round>.json and a table of medians on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
lengths=${2:-4096,16384,32704}
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release -p tandem-cli
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
llama=${LLAMA_BENCH:-$HOME/.cache/tandem-peer/build/bin/llama-bench}
[ -x "$llama" ] || { echo "no llama-bench at $llama (run ../shared/tools/build-llamacpp.sh)" >&2; exit 1; }
ik=${IK_LLAMA_BENCH:-}
out=target/bench-long-context
mkdir -p "$out"
gguf=$("$tandem" model fetch qwen2.5-coder-0.5b)
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)" >&2
for round in $(seq 1 "$rounds"); do
  for n in ${lengths//,/ }; do
    echo "[round $round/$rounds, $n tokens] tandem" >&2
    "$bench" engine --model "$gguf" --threads 2 --runs 1 --batch 1 --gen-tokens 64 \
      --prompt-tokens "$n" --context-tokens "$n" --json > "$out/$n.tandem.$round.json"
    echo "[round $round/$rounds, $n tokens] llama.cpp" >&2
    { "$llama" -m "$gguf" -t 2 -fa 1 -r 1 --no-warmup -p "$n" -n 0 -o json
      "$llama" -m "$gguf" -t 2 -fa 1 -r 1 --no-warmup -p 0 -n 64 -d "$n" -o json
    } 2>/dev/null > "$out/$n.llama.$round.json"
    if [ -n "$ik" ]; then
      echo "[round $round/$rounds, $n tokens] ik_llama.cpp" >&2
      { "$ik" -m "$gguf" -t 2 -fa 1 -rtr 1 -r 1 -p "$n" -n 0 -o json
        "$ik" -m "$gguf" -t 2 -fa 1 -rtr 1 -r 1 -p 0 -n 0 -gp "$n,64" -o json
      } 2>/dev/null > "$out/$n.ik.$round.json"
    fi
  done
done
python3 - "$out" "$rounds" "$lengths" "$ik" <<'PY'
import json, os, statistics, sys
out, rounds, lengths, ik = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
systems = ["tandem", "llama"] + (["ik"] if ik else [])

def rates(n, system, r):
    """(prefill tok/s, decode tok/s at depth n) of one round's file."""
    path = f"{out}/{n}.{system}.{r}.json"
    if system == "tandem":
        kv = json.load(open(path))["kv"][0]
        return kv["prefill_tok_s"], kv["decode"][0]["tok_s"]
    # llama-bench's JSON arrays, one per command, one after the other.
    text, rows, i, dec = open(path).read(), [], 0, json.JSONDecoder()
    while (i := text.find("[", i)) >= 0:
        value, i = dec.raw_decode(text, i)
        rows.extend(value)
    pp = next(x["avg_ts"] for x in rows if x["n_prompt"] > 0 and x["n_gen"] == 0)
    tg = next(x["avg_ts"] for x in rows if x["n_gen"] > 0)
    return pp, tg

med = {}
for n in lengths:
    for s in systems:
        got = [rates(n, s, r) for r in range(1, rounds + 1) if os.path.exists(f"{out}/{n}.{s}.{r}.json")]
        med[n, s] = tuple(statistics.median(x[i] for x in got) for i in range(2))
head = "| context | Tandem prefill | llama.cpp prefill |" + (" ik prefill |" if ik else "")
head += " Tandem / llama.cpp |" + (" Tandem / ik |" if ik else "")
head += " Tandem decode | llama.cpp decode |" + (" ik decode |" if ik else "")
head += " Tandem / llama.cpp |" + (" Tandem / ik |" if ik else "")
print(head)
print("|" + "---|" * (head.count("|") - 1))
for n in lengths:
    t, l = med[n, "tandem"], med[n, "llama"]
    k = med.get((n, "ik"))
    cells = [n, f"{t[0]:.1f}", f"{l[0]:.1f}"] + ([f"{k[0]:.1f}"] if k else [])
    cells += [f"{t[0] / l[0]:.2f}x"] + ([f"{t[0] / k[0]:.2f}x"] if k else [])
    cells += [f"{t[1]:.1f}", f"{l[1]:.1f}"] + ([f"{k[1]:.1f}"] if k else [])
    cells += [f"{t[1] / l[1]:.2f}x"] + ([f"{t[1] / k[1]:.2f}x"] if k else [])
    print("| " + " | ".join(str(c) for c in cells) + " |")
PY
