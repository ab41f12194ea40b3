# Sourced by the benchmarks that run Tandem and llama-server side by side on one GGUF
# (bench-serve.sh, bench-guidellm.sh). Expects $tandem, $llama and $out to be set.

# start_peers GGUF PORT HTTP_PORT LLAMA_PORT PARALLEL: starts `tandem up` (one prefill and one
# decode node; gRPC on PORT, HTTP on HTTP_PORT) and llama-server (both cores, PARALLEL slots, on
# LLAMA_PORT), their logs in $out/up.log and $out/llama-server.log, stops both when the script
# exits, and waits until both serve.
start_peers() {
  local gguf=$1 port=$2 hport=$3 lport=$4 parallel=$5
  peer_pids=()
  trap stop_peers EXIT
  "$tandem" up --model "$gguf" --prefill 1 --decode 1 --port "$port" --http-port "$hport" --kv-spill-temporary >"$out/up.log" 2>&1 &
  peer_pids+=($!)
  "$llama" -m "$gguf" -t 2 --parallel "$parallel" -c 16384 --port "$lport" >"$out/llama-server.log" 2>&1 &
  peer_pids+=($!)
  for _ in $(seq 600); do
    grep -q "tandem cluster is up" "$out/up.log" && curl -sf "127.0.0.1:$lport/health" >/dev/null && break
    sleep 0.1
  done
  grep -q "tandem cluster is up" "$out/up.log" || { cat "$out/up.log"; exit 1; }
  curl -sf "127.0.0.1:$lport/health" >/dev/null || { tail "$out/llama-server.log"; exit 1; }
}

stop_peers() {
  for p in "${peer_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}
