# Sourced by the scripts that run one system at a time (bench-multiturn.sh, bench-kv-spill.sh,
# bench-agent.sh, test-codex.sh, ...). Expects $tandem, $out and $port to be set (scratch sets
# the last two); $model (default smollm2) and $http_port (default 0, a free port) may be.

pid=""

# scratch: for a script that runs its own clusters one after another, a scratch directory $out
# and ports $port and $http_port (picked at random above 20000), both let go at exit, after
# stopping what is up.
scratch() {
  out=$(mktemp -d)
  port=$((20000 + RANDOM % 20000))
  http_port=$((port + 1))
  trap 'stop; rm -rf "$out"' EXIT
}

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
