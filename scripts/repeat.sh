#!/usr/bin/env bash
# Runs one cargo test selection N times and reports how many runs failed, to find and confirm
# flaky tests. With --beside COMMAND, COMMAND runs over and over in the background for the whole
# time (say, another test binary), so the tests meet a loaded machine as they do in CI.
#
#   scripts/repeat.sh N [--beside COMMAND] CARGO_TEST_ARGS... [-- TEST_BINARY_ARGS...]
#   scripts/repeat.sh 100 -p tandem-integration-tests --test mtls
#   scripts/repeat.sh 50 --beside 'cargo test -p tandem-engine' -p tandem-integration-tests --test mtls
#
# The selection is built once, and each run starts the built test binaries themselves (from
# their package's folder, as cargo does), so editing the sources meanwhile changes nothing.
# Each failed run's output stays in target/repeat/STAMP/run-I.log. Exits non-zero if any run
# failed.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: scripts/repeat.sh N [--beside COMMAND] CARGO_TEST_ARGS... [-- TEST_BINARY_ARGS...]" >&2
  exit 2
}
[ $# -ge 1 ] || usage
runs=$1
shift
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || usage
beside=""
if [ "${1:-}" = "--beside" ]; then
  [ $# -ge 2 ] || usage
  beside=$2
  shift 2
fi
cargo_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  cargo_args+=("$1")
  shift
done
[ "${1:-}" = "--" ] && shift
test_args=("$@")

logs="${CARGO_TARGET_DIR:-target}/repeat/$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$logs"
# Each test binary of the selection, as "package-folder<TAB>executable".
binaries=$(cargo test --no-run --message-format=json "${cargo_args[@]}" 2>"$logs/build.log" |
  python3 -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(os.path.dirname(m["manifest_path"]) + "\t" + m["executable"])
') || {
  cat "$logs/build.log" >&2
  exit 1
}
[ -n "$binaries" ] || { echo "repeat: the selection has no test binary" >&2; exit 2; }

if [ -n "$beside" ]; then
  # Build what runs beside before the clock starts, then keep it running until we are done, in
  # a process group of its own so that the whole group (its cargo and test processes too) ends
  # with this script.
  bash -c "$beside" >"$logs/beside.log" 2>&1 || true
  BESIDE=$beside LOG="$logs/beside.log" setsid bash -c \
    'while :; do bash -c "$BESIDE" >>"$LOG" 2>&1 || true; done' &
  load=$!
  trap 'kill -- -$load 2>/dev/null || true' EXIT
fi

failed=0
for i in $(seq 1 "$runs"); do
  log="$logs/run-$i.log"
  started=$SECONDS
  ok=1
  : >"$log"
  while IFS=$'\t' read -r dir exe; do
    (cd "$dir" && "$exe" "${test_args[@]}") >>"$log" 2>&1 || ok=0
  done <<<"$binaries"
  if [ "$ok" = 1 ]; then
    echo "run $i/$runs: ok ($((SECONDS - started)) s)"
    rm -f "$log"
  else
    failed=$((failed + 1))
    echo "run $i/$runs: FAILED ($((SECONDS - started)) s), log: $log"
    grep -E "^test .* FAILED|panicked at" "$log" | head -n 5 | sed 's/^/    /'
  fi
done
echo "repeat: $((runs - failed)) of $runs runs passed${beside:+ (beside: $beside)}"
[ "$failed" -eq 0 ]
