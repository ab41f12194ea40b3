# Sourced by fleet.sh and bench-fleet.sh: a simulated fleet (`tandem sim`) and a router over
# it. Needs $tandem and $model. Stops whatever it started on exit.
pids=()
stop_fleet() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap stop_fleet EXIT

# wait_line FILE PATTERN PID: waits up to 5 minutes for a line of FILE to match PATTERN, while
# the process PID (which writes FILE) lives.
wait_line() {
  for _ in $(seq 1 600); do
    grep -qs "$2" "$1" && return 0
    kill -0 "$3" 2>/dev/null || break
    sleep 0.5
  done
  echo "fleet: nothing matched '$2' in $1; last lines of ${1%.out}.err:" >&2
  grep -v '^  ' "${1%.out}.err" | tail -5 >&2
  return 1
}

# router_metrics: the router's Prometheus text.
router_metrics() { curl -sf "http://$grpc/metrics"; }

# up_replicas: how many replicas the router sees up.
up_replicas() { router_metrics | grep -c '^tandem_router_replica_up{.*} 1$' || true; }

# start_fleet DIR PREFILL DECODE [SIM FLAG...]: starts PREFILL + DECODE simulated nodes and a
# router over them (gRPC and HTTP on free ports), logs in DIR, and waits until the router sees
# every node up. Sets $grpc and $http (the router's addresses).
start_fleet() {
  local dir=$1 prefill=$2 decode=$3
  shift 3
  rm -f "$dir/sim.out" "$dir/router.out"
  "$tandem" sim --model "$model" --prefill "$prefill" --decode "$decode" "$@" \
    >"$dir/sim.out" 2>"$dir/sim.err" &
  pids+=($!)
  wait_line "$dir/sim.out" '^decode ' $! || return 1
  "$tandem" router --prefill "$(sed -n 's/^prefill //p' "$dir/sim.out")" \
    --decode "$(sed -n 's/^decode //p' "$dir/sim.out")" --listen 127.0.0.1:0 \
    --http-listen 127.0.0.1:0 --max-inflight 1024 >"$dir/router.out" 2>"$dir/router.err" &
  pids+=($!)
  wait_line "$dir/router.out" '^listening on' $! || return 1
  grpc=$(sed -n 's/^listening on //p' "$dir/router.out")
  http=$(sed -n 's/^http listening on //p' "$dir/router.out")
  local up=0 nodes=$((prefill + decode))
  for _ in $(seq 1 600); do
    up=$(up_replicas)
    [ "$up" -ge "$nodes" ] && return 0
    sleep 0.5
  done
  echo "fleet: $up of $nodes replicas up; see $dir" >&2
  return 1
}
