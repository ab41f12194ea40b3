#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 20; the CI pass), starting
# from the committed seeds in fuzz/corpus/TARGET and keeping what libFuzzer finds in
# fuzz/work/TARGET (ignored by git). A crash stops the script with libFuzzer's report and the
# input under fuzz/artifacts/TARGET/. Prints each target's executions.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Needs the nightly toolchain (libFuzzer's instrumentation), SmolLM2 (the targets
# fuzz its real tokenizer and chat template: `tandem model fetch smollm2`) and Gemma 3 270M (its
# SentencePiece tokenizer: `tandem model fetch gemma-3-270m`). Installs cargo-fuzz from
# crates.io when it is missing. Targets are built without a sanitizer: the code under test is
# safe Rust, and libFuzzer still catches panics (overflow checks are on), timeouts and memory
# blow-ups.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-20}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(kv_wire grpc_request http_request chat_template tokenizer)
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi
flags=(--sanitizer none --debug-assertions --fuzz-dir fuzz)
cargo +nightly fuzz build "${flags[@]}"
for t in "${targets[@]}"; do
    mkdir -p "fuzz/work/$t"
    log="fuzz/work/$t.log"
    echo "fuzzing $t for ${seconds}s" >&2
    if ! cargo +nightly fuzz run "${flags[@]}" "$t" "fuzz/work/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 -timeout=10 \
        -print_final_stats=1 >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        echo "fuzz target $t failed; the input is under fuzz/artifacts/$t/" >&2
        exit 1
    fi
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    echo "$t: $runs executions in ${seconds}s, 0 crashes"
done
