#!/usr/bin/env bash
# Runs one cargo test selection N times and reports how many runs failed, to find and confirm
# flaky tests. With --beside COMMAND, COMMAND runs over and over in the background for the whole
# time (say, another test binary), so the tests meet a loaded machine as they do in CI.
#
#   scripts/repeat.sh N [--beside COMMAND] CARGO_TEST_ARGS...
#   scripts/repeat.sh 100 -p tandem-integration-tests --test mtls
#   scripts/repeat.sh 50 --beside 'cargo test -p tandem-engine' -p tandem-integration-tests --test mtls
#
# The selection is built once first. Each run's output goes to target/repeat/run-I.log; the logs
# of the runs that passed are deleted. Exits non-zero if any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: scripts/repeat.sh N [--beside COMMAND] CARGO_TEST_ARGS..." >&2
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

logs="${CARGO_TARGET_DIR:-target}/repeat"
mkdir -p "$logs"
cargo test --no-run "$@" >"$logs/build.log" 2>&1 || {
  cat "$logs/build.log" >&2
  exit 1
}
if [ -n "$beside" ]; then
  # Build what runs beside before the clock starts, then keep it running until we are done.
  bash -c "$beside" >"$logs/beside.log" 2>&1 || true
  # In a process group of its own, so that the whole group (its cargo and test processes too)
  # ends with this script.
  BESIDE=$beside LOG="$logs/beside.log" setsid bash -c \
    'while :; do bash -c "$BESIDE" >>"$LOG" 2>&1 || true; done' &
  load=$!
  trap 'kill -- -$load 2>/dev/null || true' EXIT
fi

failed=0
for i in $(seq 1 "$runs"); do
  log="$logs/run-$i.log"
  started=$SECONDS
  if cargo test "$@" >"$log" 2>&1; then
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
