#!/usr/bin/env python3
"""Makes the GGUF files that the fidelity tests of architectures with no downloadable weights run
on: Qwen3 (`qwen3`), Qwen3's mixture of experts (`qwen3moe`) and Llama 3 (`llama` with the
`llama-bpe` tokenizer and `rope_freqs.weight`).

Each file has random weights from a fixed seed in small shapes of the real models' proportions,
and the real vocabulary (llama.cpp's vocabulary-only files), special tokens and chat template, so
that tokenizing, templates and every tensor the architecture has are exercised. Weights come
from a counter-based generator (splitmix64 of the tensor's name and the element's index), so a
file's bytes depend on nothing but this script and the `gguf` package's writer, which
`scripts/test-models.sh` pins: the llama.cpp references in `engine/tests/data/` name the SHA-256
of the file they were computed on, and the test checks it.

`--dtype q8_0` writes the matrices as Q8_0 with the `gguf` package's quantizer (bit for bit
llama-quantize's Q8_0; `scripts/test-models.sh --check-quantize` compares the two); `f32` writes
them unquantized, for llama-quantize to make other types from.

Usage: make_test_models.py --vocab-dir DIR --out-dir DIR [--dtype q8_0|f32] [--bench]
"""

import argparse
import hashlib
import math
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

SEED = 20261206

# Qwen3's special tokens after <|im_end|> (its tokenizer_config.json's added tokens): control
# tokens (3) are those in <|...|>, the rest user-defined (4), as convert_hf_to_gguf marks them.
QWEN3_ADDED = [
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
]

# Each model: its architecture, shape and tokenizer. The shapes keep the real models' ratios
# where they matter (head size 128 for Qwen3 with more query than hidden dimensions, grouped KV
# heads, Llama 3.2's head size 64 and tied embeddings, a mixture of many small experts of which
# a few run) and are small enough to make and run in seconds.
MODELS = {
    "qwen3": dict(
        arch="qwen3", vocab="qwen2", template="Qwen-Qwen3-0.6B.jinja",
        layers=4, hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=768,
        rope_theta=1_000_000.0, eps=1e-6, tied=True,
    ),
    "qwen3moe": dict(
        arch="qwen3moe", vocab="qwen2", template="Qwen-Qwen3-0.6B.jinja",
        layers=3, hidden=256, heads=4, kv_heads=1, head_dim=128, ffn=1024,
        experts=32, experts_used=4, expert_ffn=256,
        rope_theta=1_000_000.0, eps=1e-6, tied=False,
    ),
    "llama3": dict(
        arch="llama", vocab="llama-bpe", template="meta-llama-Llama-3.1-8B-Instruct.jinja",
        layers=4, hidden=256, heads=4, kv_heads=1, head_dim=64, ffn=1024,
        rope_theta=500_000.0, eps=1e-5, tied=True,
    ),
}

# Qwen3-30B-A3B's layer shapes with fewer layers (it fits this machine and shows what a decode
# step reads), for the benchmark against llama.cpp: `--bench`.
BENCH = {
    "qwen3moe-30b-a3b-shapes": dict(
        arch="qwen3moe", vocab="qwen2", template="Qwen-Qwen3-0.6B.jinja",
        layers=2, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144,
        experts=128, experts_used=8, expert_ffn=768,
        rope_theta=1_000_000.0, eps=1e-6, tied=False,
    ),
    "qwen3-8b-shapes": dict(
        arch="qwen3", vocab="qwen2", template="Qwen-Qwen3-0.6B.jinja",
        layers=2, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=12288,
        rope_theta=1_000_000.0, eps=1e-6, tied=False,
    ),
}

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def uniform(name, shape, std):
    """Values uniform in ±std·√3 (standard deviation `std`), a pure function of `name`, the
    element's index and SEED: splitmix64 of a counter."""
    n = int(np.prod(shape))
    key = int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "little")
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return ((u * 2.0 - 1.0) * (std * math.sqrt(3.0))).astype(np.float32).reshape(shape)


def llama3_rope_factors(head_dim, base):
    """Llama 3.2's rope frequency factors as convert_hf_to_gguf computes them (factor 32, low
    and high frequency factors 1 and 4, an original context of 8192)."""
    factor, low, high, old_ctx = 32.0, 1.0, 4.0, 8192
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def read_vocab(path):
    """The tokenizer fields of a llama.cpp vocabulary-only GGUF."""
    r = gguf.GGUFReader(path)

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def ints(key):
        f = r.fields[key]
        return [int(f.parts[i][0]) for i in f.data]

    return dict(
        tokens=strings("tokenizer.ggml.tokens"),
        types=ints("tokenizer.ggml.token_type"),
        merges=strings("tokenizer.ggml.merges"),
        pre=r.fields["tokenizer.ggml.pre"].contents(),
    )


def tokenizer_metadata(w, m, vocab_dir):
    v = read_vocab(os.path.join(vocab_dir, f"ggml-vocab-{m['vocab']}.gguf"))
    tokens, types = v["tokens"], v["types"]
    if m["vocab"] == "qwen2":
        # The vocabulary file predates Qwen3's added tokens: they take the padding slots.
        for i, t in enumerate(QWEN3_ADDED):
            tokens[151646 + i] = t
            types[151646 + i] = 3 if t.startswith("<|") else 4
        bos, eos, add_bos = 151643, 151645, False
    else:
        bos, eos, add_bos = 128000, 128009, True
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(v["merges"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(add_bos)
    with open(os.path.join(vocab_dir, m["template"]), encoding="utf-8") as f:
        w.add_chat_template(f.read())
    return len(tokens)


def write_model(name, m, vocab_dir, out_path, dtype):
    arch = m["arch"]
    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(f"tandem-test-{name}")
    vocab = tokenizer_metadata(w, m, vocab_dir)
    h, hd, layers = m["hidden"], m["head_dim"], m["layers"]
    q, kv = m["heads"] * hd, m["kv_heads"] * hd
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(m["ffn"])
    w.add_head_count(m["heads"])
    w.add_head_count_kv(m["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(m["rope_theta"])
    w.add_layer_norm_rms_eps(m["eps"])
    if arch == "llama":
        w.add_rope_dimension_count(hd)
        w.add_vocab_size(vocab)
    if "experts" in m:
        w.add_expert_count(m["experts"])
        w.add_expert_used_count(m["experts_used"])
        w.add_expert_feed_forward_length(m["expert_ffn"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if dtype == "q8_0" else gguf.LlamaFileType.ALL_F32)

    def matrix(tname, shape, std):
        data = uniform(tname, shape, std)
        if dtype == "q8_0":
            w.add_tensor(tname, gguf.quants.quantize(data, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(tname, data)

    def vector(tname, n, spread=0.2):
        w.add_tensor(tname, 1.0 + uniform(tname, (n,), spread / math.sqrt(3.0)))

    # Tied embeddings double as the LM head: small enough that logits spread over a few units.
    matrix("token_embd.weight", (vocab, h), 0.15 if m["tied"] else 1.0)
    if not m["tied"]:
        matrix("output.weight", (vocab, h), 0.15)
    vector("output_norm.weight", h)
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(hd, m["rope_theta"]))
    for i in range(layers):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", h)
        vector(b + "ffn_norm.weight", h)
        matrix(b + "attn_q.weight", (q, h), 1 / math.sqrt(h))
        matrix(b + "attn_k.weight", (kv, h), 1 / math.sqrt(h))
        matrix(b + "attn_v.weight", (kv, h), 1 / math.sqrt(h))
        matrix(b + "attn_output.weight", (h, q), 1 / math.sqrt(q))
        if arch != "llama":
            vector(b + "attn_q_norm.weight", hd)
            vector(b + "attn_k_norm.weight", hd)
        if "experts" in m:
            n, f = m["experts"], m["expert_ffn"]
            # The router at several times a matrix's scale, so routing is decided, not a tie.
            w.add_tensor(b + "ffn_gate_inp.weight", uniform(b + "ffn_gate_inp.weight", (n, h), 4 / math.sqrt(h)))
            matrix(b + "ffn_gate_exps.weight", (n, f, h), 1 / math.sqrt(h))
            matrix(b + "ffn_up_exps.weight", (n, f, h), 1 / math.sqrt(h))
            matrix(b + "ffn_down_exps.weight", (n, h, f), 1 / math.sqrt(f))
        else:
            f = m["ffn"]
            matrix(b + "ffn_gate.weight", (f, h), 1 / math.sqrt(h))
            matrix(b + "ffn_up.weight", (f, h), 1 / math.sqrt(h))
            matrix(b + "ffn_down.weight", (h, f), 1 / math.sqrt(f))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-dir", required=True, help="llama.cpp's models/ vocabulary files and templates")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--dtype", choices=["q8_0", "f32"], default="q8_0")
    ap.add_argument("--bench", action="store_true", help="the benchmark shapes instead of the test ones")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for name, m in (BENCH if args.bench else MODELS).items():
        path = os.path.join(args.out_dir, f"{name}.{args.dtype}.gguf")
        print(f"making {path}", file=sys.stderr, flush=True)
        write_model(name, m, args.vocab_dir, path, args.dtype)


if __name__ == "__main__":
    main()
