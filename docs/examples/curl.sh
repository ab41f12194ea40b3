#!/usr/bin/env bash
# Tandem's OpenAI-compatible HTTP API with curl. Usage: curl.sh [BASE_URL]
# (default http://127.0.0.1:8000, `tandem up`'s).
set -euo pipefail
base=${1:-http://127.0.0.1:8000}
curl -sf "$base/health"; echo
model=$(curl -sf "$base/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "model: $model"
# One completion, not streamed.
curl -sf "$base/v1/completions" -H 'content-type: application/json' -d "{
  \"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0
}"; echo
# A streamed chat reply (server-sent events), usage in the last chunk.
curl -sfN "$base/v1/chat/completions" -H 'content-type: application/json' -H 'x-session-id: demo' -d "{
  \"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"Say hello.\"}],
  \"max_tokens\": 8, \"stream\": true, \"stream_options\": {\"include_usage\": true}
}"
# A parameter Tandem does not serve is refused by name (HTTP 400), never ignored.
status=$(curl -s -o /dev/null -w '%{http_code}' "$base/v1/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": \"hi\", \"best_of\": 2}")
echo "best_of=2 -> HTTP $status"
[ "$status" = 400 ]
