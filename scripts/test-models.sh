#!/usr/bin/env bash
# Makes the test models of the architectures whose weights cannot be downloaded here (Qwen3,
# Qwen3's mixture of experts, Llama 3): random weights from a fixed seed with the real
# vocabularies and chat templates (scripts/make_test_models.py), as Q8_0, into
# ${TANDEM_TEST_MODELS_DIR:-target/test-models}, with llama.cpp's vocabulary files and tokenizer
# tests beside them in vocab/. engine/tests/synthetic.rs holds them to llama.cpp's outputs in
# engine/tests/data/synthetic/. A no-op when the files are there and are the ones the references
# name. scripts/test.sh runs it before the tests.
#
# The vocabularies and templates come from llama.cpp's repository as the PyPI sdist of
# llama-cpp-python vendors it (the version ../shared/tools/build-llamacpp.sh builds), downloaded
# once into ~/.cache/tandem/ (77 MB); the generator's `gguf` package is pinned, so the files are
# the same bytes on every machine.
#
#   scripts/test-models.sh               make the Q8_0 files (about a minute)
#   scripts/test-models.sh --references  also build llama.cpp (../shared/tools/build-llamacpp.sh,
#                                        15-20 minutes once), check that llama-quantize's Q8_0
#                                        tensors equal the generator's, make the Q4_K_M files
#                                        with llama-quantize, remake llama.cpp's references for
#                                        both and Hugging Face's renderings of the chat
#                                        templates, and run the fidelity tests on all six files
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${TANDEM_TEST_MODELS_DIR:-${CARGO_TARGET_DIR:-target}/test-models}
mkdir -p "$out"
out=$(cd "$out" && pwd)
refs=$root/engine/tests/data/synthetic
llama_cpp_python=0.3.36
cache=$HOME/.cache/tandem/llama-cpp-python-$llama_cpp_python
names=(qwen3 qwen3moe llama3)

venv=$out/venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import gguf' 2>/dev/null; then
  echo "test-models: installing gguf into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'gguf==0.19.0' 'numpy>=1.26'
fi

# llama.cpp's vocabulary-only files with their tokenizer tests, and the chat templates.
vocab=$out/vocab
files=(ggml-vocab-qwen2.gguf ggml-vocab-qwen2.gguf.inp ggml-vocab-qwen2.gguf.out
  ggml-vocab-llama-bpe.gguf ggml-vocab-llama-bpe.gguf.inp ggml-vocab-llama-bpe.gguf.out
  templates/Qwen-Qwen3-0.6B.jinja templates/meta-llama-Llama-3.1-8B-Instruct.jinja)
if [ ! -f "$vocab/meta-llama-Llama-3.1-8B-Instruct.jinja" ]; then
  sdist=$cache/llama_cpp_python-$llama_cpp_python.tar.gz
  if [ ! -f "$sdist" ]; then
    echo "test-models: downloading the llama-cpp-python $llama_cpp_python sdist (77 MB)" >&2
    mkdir -p "$cache"
    "$venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python -d "$cache" \
      "llama-cpp-python==$llama_cpp_python"
  fi
  mkdir -p "$vocab"
  prefix=llama_cpp_python-$llama_cpp_python/vendor/llama.cpp/models
  tar -xzf "$sdist" -C "$vocab" --strip-components=4 "${files[@]/#/$prefix/}"
  mv "$vocab"/templates/* "$vocab"/ && rmdir "$vocab/templates"
fi

sha() { sha256sum "$1" | cut -d' ' -f1; }
want() { "$venv/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["sha256"])' "$1"; }
fresh=yes
for n in "${names[@]}"; do
  f=$out/$n.q8_0.gguf
  if [ ! -f "$f" ] || [ "$(sha "$f")" != "$(want "$refs/$n.q8_0.json")" ]; then fresh=no; fi
done
if [ $fresh = no ]; then
  echo "test-models: making the Q8_0 test models in $out" >&2
  "$venv/bin/python" scripts/make_test_models.py --vocab-dir "$vocab" --out-dir "$out"
fi
for n in "${names[@]}"; do
  if [ "$(sha "$out/$n.q8_0.gguf")" != "$(want "$refs/$n.q8_0.json")" ] && [ "${1:-}" != --references ]; then
    echo "test-models: $out/$n.q8_0.gguf is not the file engine/tests/data/synthetic/$n.q8_0.json was" \
      "computed on: remake the references (scripts/test-models.sh --references)" >&2
    exit 1
  fi
done
[ "${1:-}" = --references ] || exit 0

bin=$(bash ../shared/tools/build-llamacpp.sh)
"$venv/bin/python" scripts/make_test_models.py --vocab-dir "$vocab" --out-dir "$out" --dtype f32
for n in "${names[@]}"; do
  "$bin/llama-quantize" "$out/$n.f32.gguf" "$out/$n.llama-q8_0.gguf" Q8_0 2 >/dev/null 2>&1
  "$bin/llama-quantize" "$out/$n.f32.gguf" "$out/$n.q4_k_m.gguf" Q4_K_M 2 >/dev/null 2>&1
  "$venv/bin/python" - "$out/$n.q8_0.gguf" "$out/$n.llama-q8_0.gguf" <<'EOF'
import hashlib, sys
import gguf
def tensors(path):
    return {t.name: (t.tensor_type, hashlib.sha256(bytes(t.data)).hexdigest()) for t in gguf.GGUFReader(path).tensors}
ours, theirs = tensors(sys.argv[1]), tensors(sys.argv[2])
if ours != theirs:
    sys.exit(f"{sys.argv[1]}: tensors unlike llama-quantize's Q8_0: {sorted(n for n in ours if ours[n] != theirs.get(n))[:5]}")
print(f"{sys.argv[1]}: every tensor equals llama-quantize's Q8_0", file=sys.stderr)
EOF
  rm -f "$out/$n.f32.gguf" "$out/$n.llama-q8_0.gguf"
done
"$venv/bin/python" scripts/llama_reference.py --server "$bin/llama-server" --models "$out" --out "$refs"
"$venv/bin/pip" install -q jinja2
"$venv/bin/python" scripts/template_reference.py --vocab-dir "$vocab" --out "$refs/templates.json"
TANDEM_TEST_MODELS_DIR=$out cargo test --release -p tandem-engine --test synthetic -- --include-ignored --nocapture
