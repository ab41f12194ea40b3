#!/usr/bin/env bash
# Sharing the cluster (issue 47), on a fresh 1P1D `tandem up` cluster of SmolLM2 per run:
#   alone         the interactive load alone: open-loop short chat turns (INTERACTIVE_RATE
#                 requests/s, 48-word prompts, 32 tokens), `--priority interactive`;
#   classes       the same interactive load beside a batch flood that alone saturates the
#                 cluster (BATCH_CLIENTS closed-loop clients, 1,200-word prompts, 128 tokens,
#                 `--priority batch`), started BATCH_LEAD seconds before it;
#   fifo          the same two loads without priorities: every request standard, first come
#                 first served, as before classes;
#   llama-server  the same two loads against llama-server (-t 2, --parallel 16), which has no
#                 classes (skipped when LLAMA_SERVER is not there);
#   slo           admission against a TTFT target: the classes run's two loads, each
#                 interactive request asking for SLO_TTFT_MS (default 400) with
#                 `--ttft-target-ms`; the router refuses at once those it predicts would miss
#                 it. Prints how many were refused and how fast, and the admitted ones' TTFT
#                 p90 against the target;
#   keys          fair shares: two keys of equal weight on a cluster whose decode node has 2
#                 slots (8 places); the heavy key keeps 6 requests in flight, the light key 16
#                 (so that it always has some queued), and the heavy key's requests carry 10
#                 times the light key's tokens (1,000-word prompts and 100 tokens against 100
#                 and 10). The router's served tokens per tenant (`tandem_router_tenant_tokens`)
#                 are read KEYS_SETTLE (30) seconds in and as the light key's load ends, while
#                 both have work queued: the shares are of the tokens served between.
#   tail          the interactive tail under a batch flood (issue 60), TAIL_RUNS times (default 5),
#                 each mode on a fresh cluster, over the OpenAI API: 20 short chat turns streamed
#                 one every 1.5 s (40-word prompts, 24 tokens) alone; then beside 12 clients
#                 sending 1,100-word prompts back to back (96 tokens, started BATCH_LEAD seconds
#                 before) with no class named (fifo); then with the flood `x-priority: batch` and
#                 the turns `interactive` (classes); `classes-nice0` (in TAIL_MODES) is classes
#                 with `tandem up --prefill-nice 0`. Prints each run's interactive TTFT p50/p99
#                 and ITL p99 over the load alone's, the batch output tokens/s beside them (the
#                 cost), and per mode the median and worst ratio;
# Prints a line per run (the interactive TTFT and ITL p50/p99, the batch requests completed),
# the ratios the issue asks for, and the keys' shares. Results: target/bench-sharing/*.json.
#
# Usage: scripts/bench-sharing.sh
# Env: TANDEM (the binary, default target/release/tandem), INTERACTIVE_RATE (default 1),
#   INTERACTIVE_REQUESTS (40), BATCH_CLIENTS (8), BATCH_REQUESTS (24), BATCH_LEAD (8),
#   LLAMA_SERVER (default the one ../shared/tools/build-llamacpp.sh builds), SLO_TTFT_MS (400),
#   RUNS (default "alone classes fifo llama-server slo keys"; `tail` only when named), TAIL_RUNS
#   (5), TAIL_MODES ("alone fifo classes"), TAIL_BATCH_REQUESTS (36: about as long as the
#   turns on a 2-vCPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/cluster.sh
out=target/bench-sharing
mkdir -p "$out"
rate=${INTERACTIVE_RATE:-1}
interactive=(--rate "$rate" --requests "${INTERACTIVE_REQUESTS:-40}" --prompt-words 48
  --max-tokens 32 --warmup 0 --seed 7)
batch=(--concurrency "${BATCH_CLIENTS:-8}" --requests "${BATCH_REQUESTS:-24}" --prompt-words 1200
  --max-tokens 128 --warmup 0 --seed 8)
lead=${BATCH_LEAD:-8}
pids=()
cleanup() {
  [ -z "${up_pid:-}" ] || down 2>/dev/null || true
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

line() { # line NAME: the interactive load's figures, and the batch load's completions
  python3 - "$out" "$1" <<'PY'
import json, os, sys
out, name = sys.argv[1], sys.argv[2]
i = json.load(open(f"{out}/{name}.interactive.json"))["levels"][0]
text = f'{name}: interactive {i["completed"]}/{i["requests"]} completed'
if i["completed"]:
    text += (f', TTFT p50/p99 {i["ttft_ms"]["p50"]:.0f}/{i["ttft_ms"]["p99"]:.0f} ms, '
             f'ITL p50/p99 {i["itl_ms"]["p50"]:.1f}/{i["itl_ms"]["p99"]:.1f} ms')
if os.path.exists(f"{out}/{name}.batch.json"):
    b = json.load(open(f"{out}/{name}.batch.json"))["levels"][0]
    text += (f'; batch {b["completed"]}/{b["requests"]} completed (failed {b["failed"]}), '
             f'{b["output_tok_s"]:.0f} output tok/s, TTFT p50 {b["ttft_ms"]["p50"]:.0f} ms')
print(text)
PY
}

# mixed NAME ENDPOINT... -- EXTRA: the batch flood, then the interactive load BATCH_LEAD seconds
# later; waits for both. EXTRA_I / EXTRA_B are the flags of each load (priorities).
mixed() {
  local name=$1
  shift
  "$bench" serve "$@" "${batch[@]}" "${extra_b[@]}" --label "$name-batch" \
    --out "$out/$name.batch.json" >"$out/$name.batch.txt" &
  local bpid=$!
  sleep "$lead"
  "$bench" serve "$@" "${interactive[@]}" "${extra_i[@]}" --label "$name-interactive" \
    --out "$out/$name.interactive.json" >"$out/$name.interactive.txt"
  wait "$bpid"
}

todo=${RUNS:-alone classes fifo llama-server slo keys}
wants() { [[ " $todo " == *" $1 "* ]]; }
if wants alone; then
  up "$out/up-alone.log" --prefill 1 --decode 1
  "$bench" serve --server "$up_addr" "${interactive[@]}" --priority interactive \
    --label alone --out "$out/alone.interactive.json" >"$out/alone.interactive.txt"
  down
  line alone
fi
if wants classes; then
  up "$out/up-classes.log" --prefill 1 --decode 1
  extra_b=(--priority batch) extra_i=(--priority interactive)
  mixed classes --server "$up_addr"
  down
  line classes
fi
if wants fifo; then
  up "$out/up-fifo.log" --prefill 1 --decode 1
  extra_b=() extra_i=()
  mixed fifo --server "$up_addr"
  down
  line fifo
fi
if wants llama-server; then
  llama=${LLAMA_SERVER:-$HOME/.cache/tandem-peer/build/bin/llama-server}
  gguf=${GGUF:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}
  if [ -x "$llama" ]; then
    "$llama" -m "$gguf" -t 2 --parallel 16 -c 65536 --port 8094 >"$out/llama-server.log" 2>&1 &
    lpid=$!
    pids+=("$lpid")
    for _ in $(seq 600); do curl -sf 127.0.0.1:8094/health >/dev/null && break; sleep 0.1; done
    extra_b=() extra_i=()
    mixed llama-server --openai http://127.0.0.1:8094/v1
    kill -TERM "$lpid"; wait "$lpid" 2>/dev/null || true
    line llama-server
  else
    echo "no llama-server at $llama (run ../shared/tools/build-llamacpp.sh): skipped" >&2
  fi
fi
if wants slo; then
  slo=${SLO_TTFT_MS:-400}
  up "$out/up-slo.log" --prefill 1 --decode 1
  extra_b=(--priority batch) extra_i=(--priority interactive --ttft-target-ms "$slo")
  mixed slo --server "$up_addr"
  down
  line slo
  python3 - "$out" "$slo" <<'PY'
import json, sys
out, target = sys.argv[1], float(sys.argv[2])
i = json.load(open(f"{out}/slo.interactive.json"))["levels"][0]
refused = i["failed"].get("ResourceExhausted", 0)
others = sum(n for code, n in i["failed"].items() if code != "ResourceExhausted")
took = i["failed_ms"]
text = f'slo: target {target:.0f} ms: {refused} of {i["requests"]} refused'
if took:
    text += f' (in p50/p99 {took["p50"]:.1f}/{took["p99"]:.1f} ms)'
if i["completed"]:
    p90 = i["ttft_ms"]["p90"]
    text += (f'; {i["completed"]} admitted, TTFT p90 {p90:.0f} ms '
             f'({"meets" if p90 <= target else "misses"} the target)')
print(text + (f'; {others} failed otherwise' if others else ''))
PY
fi
if wants alone && wants classes && wants fifo; then
  python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
p99 = lambda n, k: json.load(open(f"{out}/{n}.interactive.json"))["levels"][0][k]["p99"]
print(f'interactive TTFT p99: classes {p99("classes", "ttft_ms"):.0f} ms, '
      f'{p99("classes", "ttft_ms") / p99("fifo", "ttft_ms"):.3f} of FIFO\'s {p99("fifo", "ttft_ms"):.0f} ms; '
      f'ITL p99: classes {p99("classes", "itl_ms"):.1f} ms, '
      f'{p99("classes", "itl_ms") / p99("alone", "itl_ms"):.2f}x the load alone ({p99("alone", "itl_ms"):.1f} ms); '
      f'FIFO {p99("fifo", "itl_ms") / p99("alone", "itl_ms"):.2f}x')
PY
fi

if wants tail; then
  tail_i=(--rate 0.667 --burstiness 100 --requests 20 --prompt-words 40 --max-tokens 24
    --warmup 0 --seed 7)
  tail_b=(--concurrency 12 --requests "${TAIL_BATCH_REQUESTS:-36}" --prompt-words 1100
    --max-tokens 96 --warmup 0 --seed 8)
  modes=${TAIL_MODES:-alone fifo classes}
  for r in $(seq "${TAIL_RUNS:-5}"); do
    # A fresh cluster for each: the flood's prompts cached from an earlier mode would be
    # prefilled on the decode node instead.
    for mode in $modes; do
      xb=() xi=() flags=()
      case $mode in
        classes) xb=(--priority batch) xi=(--priority interactive) ;;
        classes-nice0) xb=(--priority batch) xi=(--priority interactive) flags=(--prefill-nice 0) ;;
      esac
      up "$out/up-tail-$r-$mode.log" --prefill 1 --decode 1 "${flags[@]}"
      bpid=
      if [ "$mode" != alone ]; then
        "$bench" serve --openai "$up_http" "${tail_b[@]}" "${xb[@]}" --label "tail-$r-$mode-batch" \
          --out "$out/tail-$r.$mode.batch.json" >/dev/null &
        bpid=$!
        sleep "$lead"
      fi
      "$bench" serve --openai "$up_http" "${tail_i[@]}" "${xi[@]}" --label "tail-$r-$mode" \
        --out "$out/tail-$r.$mode.json" >/dev/null
      [ -z "$bpid" ] || wait "$bpid"
      down
    done
  done
  python3 - "$out" "${TAIL_RUNS:-5}" $modes <<'PY'
import json, statistics, sys
out, runs, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
level = lambda f: json.load(open(f"{out}/{f}.json"))["levels"][0]
ratios = {m: [] for m in modes}
for r in range(1, runs + 1):
    alone = level(f"tail-{r}.alone")["itl_ms"]["p99"] if "alone" in modes else None
    for m in modes:
        i = level(f"tail-{r}.{m}")
        text = (f'tail run {r} {m}: TTFT p50/p99 {i["ttft_ms"]["p50"]:.0f}/{i["ttft_ms"]["p99"]:.0f} ms, '
                f'ITL p99 {i["itl_ms"]["p99"]:.1f} ms')
        if alone and m != "alone":
            ratios[m].append((i["itl_ms"]["p99"] / alone, i["ttft_ms"]["p99"]))
            text += f' = {i["itl_ms"]["p99"] / alone:.2f}x alone'
        if m != "alone":
            b = level(f"tail-{r}.{m}.batch")
            text += f'; batch {b["output_tok_s"]:.0f} output tok/s, {b["completed"]}/{b["requests"]}'
        print(text)
for m, rs in ratios.items():
    if rs:
        print(f'tail {m}: ITL p99 over alone median {statistics.median(x[0] for x in rs):.2f}x, '
              f'worst {max(x[0] for x in rs):.2f}x; TTFT p99 median '
              f'{statistics.median(x[1] for x in rs):.0f} ms, worst {max(x[1] for x in rs):.0f} ms')
PY
fi

if wants keys; then
  keys=$out/keys
  rm -f "$keys"
  heavy=$("$tandem" keys new --file "$keys" --tenant heavy --rpm 0 --tpm 0 --streams 0)
  light=$("$tandem" keys new --file "$keys" --tenant light --rpm 0 --tpm 0 --streams 0)
  TANDEM_MAX_SLOTS=2 up "$out/up-keys.log" --prefill 1 --decode 1 --api-keys "$keys"
  "$bench" serve --server "$up_addr" --api-key "$heavy" --concurrency 6 --requests 400 \
    --prompt-words 1000 --max-tokens 100 --warmup 0 --seed 9 --label heavy \
    --out "$out/keys.heavy.json" >"$out/keys.heavy.txt" 2>&1 &
  hpid=$!
  pids+=("$hpid")
  # The counters once both loads have settled (the first places go to whoever asks first).
  ( sleep "${KEYS_SETTLE:-30}"; curl -sf "http://$up_addr/metrics" >"$out/keys.start.txt" ) &
  "$bench" serve --server "$up_addr" --api-key "$light" --concurrency 16 --requests 160 \
    --prompt-words 100 --max-tokens 10 --warmup 0 --seed 10 --label light \
    --out "$out/keys.light.json" >"$out/keys.light.txt"
  curl -sf "http://$up_addr/metrics" >"$out/keys.metrics.txt"
  kill -TERM "$hpid" 2>/dev/null || true
  wait "$hpid" 2>/dev/null || true
  down
  python3 - "$out/keys.start.txt" "$out/keys.metrics.txt" <<'PY'
import re, sys
def served(path):
    text = open(path).read()
    return {m[1]: float(m[2]) for m in re.finditer(r'tandem_router_tenant_tokens_total\{tenant="(\w+)"\} ([0-9.e+]+)', text)}
start, end = served(sys.argv[1]), served(sys.argv[2])
delta = {t: end[t] - start.get(t, 0.0) for t in end}
total = sum(delta.values())
print("keys: tokens served from the settled start to the light key's last request: " +
      ", ".join(f"{t} {n:.0f} ({n / total:.3f})" for t, n in sorted(delta.items())))
PY
fi
