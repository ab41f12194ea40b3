#!/usr/bin/env bash
# Claude Code itself, headless, against an Anthropic Messages endpoint: two turns of one
# session (`claude -p PROMPT`, then `claude -p PROMPT --continue`) in a fresh working directory,
# each timed (TTFT: from the command's start to the turn's first streamed content, Claude
# Code's own start-up included; the turn's whole time) with the usage Claude Code reports (input tokens computed and read from a cache,
# output tokens). Claude Code's CLI ships inside PyPI's claude-agent-sdk wheel, installed into
# target/claude-code-venv on first use.
#
# Usage: [CLAUDE_WORKDIR=DIR] scripts/bench-claude-code.sh BASE_URL [LABEL]
#        (BASE_URL e.g. http://127.0.0.1:8000)
# Prints one JSON line per turn.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/bench-claude-code.sh BASE_URL [LABEL]}
label=${2:-run}
venv=target/claude-code-venv
if ! "$venv/bin/python" -c "import claude_agent_sdk" 2>/dev/null; then
  python3 -m venv --clear "$venv"
  "$venv/bin/pip" install --quiet claude-agent-sdk==0.2.189
fi
claude=$("$venv/bin/python" -c "import claude_agent_sdk, os; print(os.path.join(os.path.dirname(claude_agent_sdk.__file__), '_bundled', 'claude'))")
# CLAUDE_WORKDIR: the working directory (and HOME) to run in, kept; by default a fresh one,
# removed at the end. Claude Code's system prompt names it, so runs that should share a prompt
# (a project opened again) share one.
if [ -n "${CLAUDE_WORKDIR:-}" ]; then
  work=$CLAUDE_WORKDIR
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
"$venv/bin/python" - "$claude" "$base" "$label" "$work" <<'PY'
import json, os, subprocess, sys, time
claude, base, label, work = sys.argv[1:]
env = dict(os.environ, ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY="sk-local",
           CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
           HOME=work, API_TIMEOUT_MS="1800000")
turns = [("What is 2+2? Answer with one number.", []),
         ("And what is that number times 3? Answer with one number.", ["--continue"])]
for n, (prompt, more) in enumerate(turns, 1):
    cmd = [claude, "-p", prompt, "--output-format", "stream-json", "--verbose",
           "--include-partial-messages", *more]
    start = time.time()
    first = None
    result = {}
    p = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        inner = event.get("event", {})
        if (event.get("type") == "stream_event" and inner.get("type") == "content_block_delta"
                and first is None):
            first = time.time()
        if event.get("type") == "result":
            result = event
    p.wait()
    usage = result.get("usage", {})
    print(json.dumps({
        "label": label, "turn": n, "is_error": result.get("is_error", True),
        "result": result.get("result"),
        "seconds": round(time.time() - start, 2),
        "ttft_seconds": round(first - start, 2) if first else None,
        "input_tokens": usage.get("input_tokens"),
        "cache_read_input_tokens": usage.get("cache_read_input_tokens"),
        "output_tokens": usage.get("output_tokens"),
    }), flush=True)
PY
