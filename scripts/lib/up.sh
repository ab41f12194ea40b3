# Sourced by the benchmarks that run one system at a time (bench-multiturn.sh,
# bench-kv-spill.sh, bench-agent.sh). Expects $tandem, $out and $port to be set; $model (default
# smollm2) and $http_port (default 0, a free port) may be.

pid=""

# stop: stops what was started last (SIGTERM, so that a cluster drains) and waits for it.
stop() {
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi
}

# up FLAGS...: starts `tandem up --model $model` with the router on $port (HTTP on
# $http_port) and FLAGS (a temporary disk tier unless FLAGS name one), its log in $out/up.log,
# and waits until it says it is up.
up() {
  # Cold unless the caller names a disk tier: no blocks kept from an earlier run.
  local tier=(--kv-spill-temporary)
  case " $* " in *" --kv-spill-dir "*|*" --kv-spill-mb 0 "*|*" --kv-spill-temporary "*) tier=() ;; esac
  "$tandem" up --model "${model:-smollm2}" --port "$port" --http-port "${http_port:-0}" "${tier[@]}" "$@" >"$out/up.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q "tandem cluster is up" "$out/up.log" && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$out/up.log"; return 1; }
    sleep 0.1
  done
  echo "tandem up did not come up" >&2; return 1
}
