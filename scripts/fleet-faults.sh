#!/usr/bin/env bash
# Faults at scale, on simulated workers (`tandem sim`): 56 prefill and 200 decode nodes in
# groups, each group one process on fixed ports that the router lists from its start, so that a
# group can be killed, drained (SIGTERM: every node drains, handing its sessions off), paused (a
# node cut off: it answers nothing) or started again. Multi-turn chat (`tandem-bench multiturn`,
# retrying a failed turn under its request id as a client of a restarted router does) runs twice
# over the same conversations: once with no fault, and once while, a few seconds apart,
#   1. a decode group of 20 (10% of the decode nodes) is killed (SIGKILL),
#   2. another 20 drain (SIGTERM),
#   3. one prefill node is paused (SIGSTOP) for 10 s, then let go,
#   4. the router is killed and started again on the same ports,
#   5. the killed group is started again;
# and a third time while decode scales from 60 nodes to 200 (seven groups started) and, 40 s
# later, back to 60 (those seven drain, handing their sessions off).
# It fails on a turn that did not complete, on a reply that differs from the fault-free run's
# (the simulated tokens are a function of the prompt, so every continuation is checkable), or on
# a cache index of a node that is up and not back in sync (exact, current within 5 s) within 60 s
# of the last fault; it prints how long the index took.
#
# Usage: scripts/fleet-faults.sh
# Env: TANDEM, TANDEM_BENCH (default target/release/, built if missing), FLEET_MODEL (default
#      smollm2), FLEET_DIR (default target/fleet-faults), FLEET_BASE_PORT (default 61000, above
#      Linux's ephemeral ports, which an outbound connection could hold when a group restarts;
#      the router takes it, the nodes the 800 ports after).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/cluster.sh
model=${FLEET_MODEL:-smollm2}
dir=${FLEET_DIR:-target/fleet-faults}
base=${FLEET_BASE_PORT:-61000}
mkdir -p "$dir"
rm -f "$dir"/*.out "$dir"/*.err "$dir/pids"
"$tandem" model fetch "$model" >/dev/null
. scripts/lib/fleet.sh
# Processes started in the background fault sequence are not in $pids: every start is also noted
# in $dir/pids, and all are stopped (a paused one let go first) on exit.
stop_all() {
  local all
  all=$(cat "$dir/pids" 2>/dev/null || true)
  # shellcheck disable=SC2086
  [ -z "$all" ] || { kill -CONT $all 2>/dev/null || true; kill -TERM $all 2>/dev/null || true; }
  stop_fleet
}
trap stop_all EXIT

# Groups: prefill A (55 nodes), prefill B (1 node, the one paused), decode 0-9 (20 each).
declare -A group_pid
group_args() {
  case $1 in
    pa) echo "--prefill 55 --decode 0 --base-port $((base + 100))" ;;
    pb) echo "--prefill 1 --decode 0 --base-port $((base + 199))" ;;
    d*) echo "--prefill 0 --decode 20 --base-port $((base + 200 + ${1#d} * 60))" ;;
  esac
}
start_group() {
  # shellcheck disable=SC2046
  "$tandem" sim --model "$model" $(group_args "$1") --kv-budget-mb 64 \
    >"$dir/$1.out" 2>>"$dir/$1.err" &
  group_pid[$1]=$!
  echo $! >>"$dir/pids"
  wait_line "$dir/$1.out" '^decode ' $! || return 1
}
addrs() {
  local role=$1 list=()
  for g in "${@:2}"; do list+=("$(sed -n "s/^$role //p" "$dir/$g.out")"); done
  local IFS=,
  echo "${list[*]}"
}
start_router() {
  "$tandem" router --prefill "$(addrs prefill pa pb)" \
    --decode "$(addrs decode d0 d1 d2 d3 d4 d5 d6 d7 d8 d9)" --listen "127.0.0.1:$base" \
    --http-listen off --max-inflight 1024 >>"$dir/router.out" 2>>"$dir/router.err" &
  router_pid=$!
  echo $! >>"$dir/pids"
}
# in_sync: how many replicas are up, and how many of those have an index exact and current
# within 5 s.
in_sync() {
  router_metrics | python3 -c '
import re, sys
up, exact, fresh = set(), set(), set()
for line in sys.stdin:
    m = re.match(r"(\w+)\{([^}]*)\} (\S+)$", line.strip())
    if not m:
        continue
    name, labels, v = m.group(1), m.group(2), float(m.group(3))
    replica, role = re.search(r"replica=\"([^\"]+)\"", labels), re.search(r"role=\"(\w+)\"", labels)
    if not (replica and role):
        continue
    key = replica.group(1) + "/" + role.group(1)
    if name == "tandem_router_replica_up" and v == 1:
        up.add(key)
    if name == "tandem_router_index_mode" and "mode=\"exact\"" in labels and v == 1:
        exact.add(key)
    if name == "tandem_router_index_seconds_since_sync" and v <= 5:
        fresh.add(key)
print(len(up), len(up & exact & fresh))'
}
grpc=127.0.0.1:$base

for g in pa pb d0 d1 d2 d3 d4 d5 d6 d7 d8 d9; do start_group "$g"; done
start_router
wait_line "$dir/router.out" '^listening on' "$router_pid"
until [ "$(up_replicas)" -ge 256 ]; do sleep 0.5; done
echo "fleet-faults: 256 nodes up" >&2

run() {
  "$bench" multiturn --server "$grpc" --sessions 64 --turns 12 --concurrency 32 --max-tokens 128 \
    --message-words 40 --retries 100 --label "$1" --json >"$dir/$1.json"
}
run reference

faults() {
  sleep 3
  echo "fleet-faults: killing decode group d1 (20 nodes)" >&2
  kill -KILL "${group_pid[d1]}"
  sleep 3
  echo "fleet-faults: draining decode group d2 (20 nodes)" >&2
  kill -TERM "${group_pid[d2]}"
  sleep 3
  echo "fleet-faults: pausing prefill node pb" >&2
  kill -STOP "${group_pid[pb]}"
  sleep 3
  echo "fleet-faults: restarting the router" >&2
  kill -KILL "$router_pid"
  start_router
  sleep 4
  kill -CONT "${group_pid[pb]}"
  echo "fleet-faults: starting decode group d1 again" >&2
  start_group d1
  # Under the load still running: every node that is up (all but the drained group) with its
  # index exact and current.
  local t0 up good
  t0=$(date +%s.%N)
  for _ in $(seq 1 120); do
    read -r up good < <(in_sync)
    if [ "$up" -ge 236 ] && [ "$good" -eq "$up" ]; then
      python3 -c "import time; print(f'{time.time() - $t0:.1f}')" >"$dir/synced"
      return 0
    fi
    sleep 0.5
  done
  echo "fleet-faults: index not in sync 60 s after the last fault ($good of $up); see $dir" >&2
  return 1
}
rm -f "$dir/synced"
faults &
fault_pid=$!
run faulted
wait "$fault_pid"
synced=$(cat "$dir/synced")

# Scaling under load: decode from 60 nodes (groups d0-d2) to 200 and back, through the drain's
# hand-off.
wait "${group_pid[d2]}" 2>/dev/null || true
start_group d2
for g in d3 d4 d5 d6 d7 d8 d9; do kill -TERM "${group_pid[$g]}"; done
for g in d3 d4 d5 d6 d7 d8 d9; do wait "${group_pid[$g]}" 2>/dev/null || true; done
scale() {
  sleep 5
  echo "fleet-faults: scaling decode up from 60 to 200 nodes" >&2
  for g in d3 d4 d5 d6 d7 d8 d9; do start_group "$g"; done
  sleep 40
  echo "fleet-faults: scaling decode down from 200 to 60 nodes (drains)" >&2
  for g in d3 d4 d5 d6 d7 d8 d9; do kill -TERM "${group_pid[$g]}"; done
}
scale &
scale_pid=$!
run scaled
wait "$scale_pid"

python3 - "$dir" "$synced" <<'EOF'
import json, sys
d, synced = sys.argv[1:3]
ref = json.load(open(f"{d}/reference.json"))
want = {(t["session"], t["turn"]): t["text"] for t in ref["turns"]}
bad = False
for run in ("faulted", "scaled"):
    got = json.load(open(f"{d}/{run}.json"))
    have = {(t["session"], t["turn"]): t["text"] for t in got["turns"]}
    missing = sorted(set(want) - set(have))
    differ = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
    s = got["summary"]
    print(f"fleet faults, {run}: {len(have)} of {len(want)} turns, {len(differ)} differ from the "
          f"fault-free run; {s['retried_turns']} turns retried ({s['retries']} retries); "
          f"decode max/mean {s['decode_max_over_mean']:.2f}")
    if missing or differ:
        print(f"fleet faults, {run}: missing {missing[:5]}, differing {differ[:5]}", file=sys.stderr)
        bad = True
print(f"fleet faults: every up node's index in sync {synced} s after the last fault")
sys.exit(1 if bad else 0)
EOF
