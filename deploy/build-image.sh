#!/usr/bin/env bash
# Builds the `tandem` binary statically linked (glibc, `-C target-feature=+crt-static`) and the
# FROM-scratch image around it, in one step.
#
# Usage: deploy/build-image.sh [TAG [FEATURES]]     (default tandem:latest, no features)
#   FEATURES: cargo features of tandem-cli; the chaos suite builds `tandem:chaos failpoints`
#   (test-only fault injection, never in a shipped image).
# The binary is also left at target/image/tandem. Naming the target explicitly keeps build
# scripts and proc macros dynamically linked; only the shipped binary is static.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-tandem:latest}
features=${2:-}
target=$(rustc -vV | sed -n 's/^host: //p')
# --config appends to .cargo/config.toml's rustflags (target-cpu); RUSTFLAGS would replace them
# and leave the kernels without AVX2.
cargo build --release --locked --target "$target" -p tandem-cli --features "$features" \
  --config "target.$target.rustflags=[\"-C\", \"target-feature=+crt-static\"]"
ctx=target/image
mkdir -p "$ctx"
# The image needs no debug info (the release profile keeps it for profiling).
strip --strip-debug -o "$ctx/tandem" "${CARGO_TARGET_DIR:-target}/$target/release/tandem"
# A static binary has no interpreter to load; refuse to ship one that does.
if readelf -l "$ctx/tandem" | grep -q 'Requesting program interpreter'; then
  echo "build-image: target/image/tandem is dynamically linked" >&2
  exit 1
fi
docker build --quiet -f deploy/Dockerfile -t "$tag" "$ctx" >/dev/null
echo "built image $tag ($(du -h "$ctx/tandem" | cut -f1) binary)"
