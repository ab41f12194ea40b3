#!/usr/bin/env bash
# A rolling restart of every decode node during `tandem-bench multiturn`, against the same
# workload undisturbed, back to back on this machine, ROUNDS times. The cluster is one prefill
# and two decode nodes behind one router, each its own process (so that one can be restarted),
# started fresh for each run:
#   undisturbed  the workload, nothing restarted
#   restart      each decode node in turn gets SIGTERM and drains (its running streams hand
#                off to the peer with their KV, its cached sessions move to the peer), then
#                starts again on the same port: at 30% and 60% of the undisturbed run's time
#   no-handoff   the same restarts with `--drain-handoff-ms 0` (streams fail over and
#                recompute; sessions do not move): what the hand-off buys
# For each, the script prints follow-up TTFT p50 (every follow-up, and those sent while a node
# was restarting against the same turns undisturbed), the replies that differ from the
# undisturbed run's (greedy decoding: each must be exact), and what moved: streams handed off
# (from the drained nodes' logs), sessions moved and tokens fetched (the router's counters).
#
# Usage: scripts/bench-rolling-restart.sh [ROUNDS] [`tandem-bench multiturn` flags...]
#   (the flags replace the default workload: --sessions 16 --turns 6 --max-tokens 48
#   --concurrency 4)
# Env: TANDEM (the binary, default target/release/tandem), MODEL (default smollm2).
# Results: target/bench-rolling-restart/ (JSON per run, node logs, router metrics).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release -p tandem-cli
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
model=${MODEL:-smollm2}
"$tandem" model fetch "$model" >/dev/null
out=target/bench-rolling-restart
mkdir -p "$out"
flags=(--sessions 16 --turns 6 --max-tokens 48 --concurrency 4)
[ $# -eq 0 ] || flags=("$@")
router=127.0.0.1:50190
prefill=127.0.0.1:50191
decode=(127.0.0.1:50192 127.0.0.1:50193)

now_ms() { date +%s%3N; }

# node NAME ROLE ADDR [FLAG...]: starts a worker, its log appended to $out/NAME.log and its pid
# in $out/NAME.pid (a file: the restarts run in a subshell).
node() {
  local name=$1 role=$2 addr=$3
  shift 3
  "$tandem" "$role" --listen "$addr" --model "$model" --threads 1 "$@" >>"$out/$name.log" 2>&1 &
  echo $! >"$out/$name.pid"
}

# ready ADDR: waits until the server at ADDR answers SERVING.
ready() {
  for _ in $(seq 600); do
    "$tandem" healthcheck --addr "$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "$1 did not come up" >&2
  return 1
}

# routed ADDR: waits until the router counts the replica at ADDR up again (a rolling restart
# moves on to the next node only then, as a Kubernetes rollout waits for readiness).
routed() {
  for _ in $(seq 600); do
    curl -s "http://$router/metrics" | grep -q "^tandem_router_replica_up{.*replica=\"$1\".*} 1" && return 0
    sleep 0.1
  done
  echo "the router does not see $1 up" >&2
  return 1
}

# stop_node NAME: SIGTERM (the node drains), then waits for it to exit.
stop_node() {
  local pid
  pid=$(cat "$out/$1.pid" 2>/dev/null) || return 0
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  rm -f "$out/$1.pid"
}

# cluster [DECODE FLAG...]: a fresh cluster, each node's log started anew.
cluster() {
  rm -f "$out"/{prefill,decode-0,decode-1,router}.log
  for a in "$router" "$prefill" "${decode[@]}"; do
    if "$tandem" healthcheck --addr "$a" >/dev/null 2>&1; then
      echo "another server answers on $a; stop it first" >&2
      exit 1
    fi
  done
  node prefill prefill "$prefill"
  node decode-0 decode "${decode[0]}" "$@"
  node decode-1 decode "${decode[1]}" "$@"
  for a in "$prefill" "${decode[@]}"; do ready "$a"; done
  "$tandem" router --listen "$router" --http-listen 127.0.0.1:0 --prefill "$prefill" \
    --decode "$(IFS=,; echo "${decode[*]}")" >>"$out/router.log" 2>&1 &
  echo $! >"$out/router.pid"
  ready "$router"
  # The router serves once one decode replica is up; give it a moment to see them all.
  sleep 1
}

# teardown [LABEL]: stops the cluster, and keeps its logs as $out/LABEL.NAME.log.
teardown() {
  for n in router decode-0 decode-1 prefill; do
    stop_node "$n"
    [ -z "${1:-}" ] || cp "$out/$n.log" "$out/$1.$n.log" 2>/dev/null || true
  done
}
trap 'teardown' EXIT

# restarts AT_MS... [-- DECODE FLAG...]: at each time (ms from now) restarts the next decode
# node; writes the window (first SIGTERM, last node SERVING again, Unix ms) to $out/window.
restarts() {
  local t0 first="" i=0 at
  t0=$(now_ms)
  local times=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do times+=("$1"); shift; done
  shift || true
  for at in "${times[@]}"; do
    sleep "$(awk -v t="$((t0 + at - $(now_ms)))" 'BEGIN { print (t > 0 ? t / 1000 : 0) }')"
    [ -n "$first" ] || first=$(now_ms)
    echo "restarting decode-$i" >&2
    stop_node "decode-$i"
    node "decode-$i" decode "${decode[$i]}" "$@"
    ready "${decode[$i]}"
    routed "${decode[$i]}"
    i=$((i + 1))
  done
  echo "$first $(now_ms)" >"$out/window"
}

run() { # label round, then bench flags
  local label=$1 r=$2
  shift 2
  "$bench" multiturn --server "$router" "${flags[@]}" --label "$label" --json "$@" \
    >"$out/$label.$r.json"
}

for r in $(seq "$rounds"); do
  echo "== round $r of $rounds" >&2
  cluster
  run undisturbed "$r"
  teardown "undisturbed.$r"
  span=$(python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['turns']; print(int(max(x['sent_ms']+x['total_ms'] for x in t)))" "$out/undisturbed.$r.json")
  for system in restart no-handoff; do
    extra=()
    [ "$system" = no-handoff ] && extra=(--drain-handoff-ms 0)
    cluster "${extra[@]}"
    restarts $((span * 3 / 10)) $((span * 6 / 10)) -- "${extra[@]}" &
    restarter=$!
    run "$system" "$r"
    wait "$restarter"
    cp "$out/window" "$out/$system.$r.window"
    curl -s "http://$router/metrics" | grep -E '^tandem_router_(moved_session|fetched_tokens|computed_prompt|failovers)' \
      >"$out/$system.$r.metrics" || true
    grep -h "hand-off over" "$out"/decode-*.log | sed 's/\x1b\[[0-9;]*m//g' >"$out/$system.$r.handoffs" || true
    teardown "$system.$r"
  done
done

python3 - "$out" "$rounds" <<'EOF'
import json, re, statistics, sys, os
out, rounds = sys.argv[1], int(sys.argv[2])
cpu = open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()
load = lambda p: json.load(open(p))
key = lambda t: (t['session'], t['turn'])
def figures(system, r):
    base = {key(t): t for t in load(f"{out}/undisturbed.{r}.json")['turns']}
    res = load(f"{out}/{system}.{r}.json")
    turns = res['turns']
    follow = [t for t in turns if t['turn'] > 0]
    f = {'p50': statistics.median(t['ttft_ms'] for t in follow),
         'base_p50': statistics.median(base[key(t)]['ttft_ms'] for t in follow),
         'differ': sum(1 for t in turns if t['text'] != base[key(t)]['text']),
         'resumed': sum(1 for t in turns if t['attempts'] > 1),
         'resumed_fetched': sum(t['fetched_tokens'] for t in turns if t['attempts'] > 1)}
    if system != 'undisturbed':
        w0, w1 = map(int, open(f"{out}/{system}.{r}.window").read().split())
        inside = [t for t in follow if w0 <= res['started_unix_ms'] + t['sent_ms'] <= w1]
        f['window'] = len(inside)
        f['window_p50'] = statistics.median(t['ttft_ms'] for t in inside) if inside else float('nan')
        f['window_base_p50'] = statistics.median(base[key(t)]['ttft_ms'] for t in inside) if inside else float('nan')
        text = open(f"{out}/{system}.{r}.metrics").read()
        m = lambda n: sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(n))
        f['moved_sessions'] = m('tandem_router_moved_sessions_total')
        f['moved_tokens'] = m('tandem_router_moved_session_tokens_total')
        f['fetched'] = m('tandem_router_fetched_tokens_total')
        logs = open(f"{out}/{system}.{r}.handoffs").read()
        f['handed_off'] = sum(int(x) for x in re.findall(r'streams_handed_off=(\d+)', logs))
    return f
print(f"rolling restart of 2 decode nodes under bench multiturn, {rounds} rounds (CPU: {cpu})")
print("| system | round | follow-up TTFT p50 ms (same turns undisturbed) | ratio | while restarting: follow-ups, p50 ms (undisturbed) | ratio | replies differing | streams handed off | resumed streams (their fetched tokens) | sessions moved (tokens) |")
print("|---|---|---|---|---|---|---|---|---|---|")
ratios = {}
for system in ['restart', 'no-handoff']:
    for r in range(1, rounds + 1):
        if not os.path.exists(f"{out}/{system}.{r}.json"):
            continue
        f = figures(system, r)
        ratio, wratio = f['p50'] / f['base_p50'], f['window_p50'] / f['window_base_p50']
        ratios.setdefault(system, []).append((ratio, wratio))
        print(f"| {system} | {r} | {f['p50']:.0f} ({f['base_p50']:.0f}) | {ratio:.2f}x | {f['window']}, {f['window_p50']:.0f} ({f['window_base_p50']:.0f}) | {wratio:.2f}x | "
              f"{f['differ']} | {f['handed_off']} | {f['resumed']} ({f['resumed_fetched']}) | {f['moved_sessions']:.0f} ({f['moved_tokens']:.0f}) |")
for system, rs in ratios.items():
    print(f"{system}: median ratio {statistics.median(x for x, _ in rs):.2f}x over all follow-ups, "
          f"{statistics.median(y for _, y in rs):.2f}x while restarting")
EOF
