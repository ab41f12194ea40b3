# Sourced by the benchmark scripts that compare `tandem up` clusters one after another
# (bench-tls.sh, bench-speculate.sh, bench-overload.sh, bench-sharing.sh) and by bench-sim.sh and
# bench-fleet.sh for the binaries. Sets $tandem: $TANDEM,
# or target/release/tandem, and $bench: $TANDEM_BENCH, or target/release/tandem-bench, each built
# if missing.
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release -p tandem-cli
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench

# up LOG [FLAG...]: starts `tandem up --model smollm2` on free ports with the FLAGs, its output
# in LOG, and waits until it prints the router's addresses; sets $up_pid, $up_addr (gRPC) and
# $up_http (the OpenAI API's base URL). Its logs (stderr, filtered by RUST_LOG) go to
# $UP_STDERR, by default nowhere.
up() {
  local log=$1
  shift
  "$tandem" up --model smollm2 --port 0 --http-port 0 --kv-spill-temporary "$@" >"$log" 2>"${UP_STDERR:-/dev/null}" &
  up_pid=$!
  for _ in $(seq 1 120); do grep -q "(OpenAI HTTP)" "$log" && break; sleep 0.5; done
  up_addr=$(grep "router (gRPC" "$log" | awk '{print $NF}')
  [ -n "$up_addr" ] || { echo "tandem up did not start; see $log" >&2; return 1; }
  up_http=$(grep -m1 "(OpenAI HTTP)" "$log" | awk '{print $NF}')
}

# down: stops the cluster `up` started (SIGTERM; each node drains) and waits for it.
down() {
  kill -TERM "$up_pid"
  wait "$up_pid" || true
}
