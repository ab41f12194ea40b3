#!/usr/bin/env python3
"""Computes llama.cpp's reference outputs on the test models of make_test_models.py: for each
prompt, llama-server's token ids (special tokens parsed, the file's BOS rule), its greedy
continuation and, at every generated position, its top 20 log-probabilities of the full softmax.
Writes one JSON file per model, named by the GGUF's SHA-256, for engine/tests/synthetic.rs.

Usage: llama_reference.py --server PATH/llama-server --models DIR --out DIR [--port N]
(`scripts/test-models.sh --references` runs it; llama.cpp from ../shared/tools/build-llamacpp.sh.)
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request

# Prompts in several scripts, code, numbers and each model's chat markup.
TEXTS = [
    "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):",
    "In 2024, 1,234,567 people paid $3.14159 each; 12345678 × 9 = 111111102.",
    "Emoji 🦙🚀 and accents: café, naïve, Ελληνικά — 東京 and 서울.\n\n\tTabs  and   spaces",
]
# A long prompt (about 1,500 tokens): positions where Llama 3's rope frequency factors turn
# the low frequencies by whole radians, and prefill chunks of many rows per expert.
TEXTS.append("\n".join(f"{i}. {TEXTS[i % len(TEXTS)]}" for i in range(48)))
CHAT = {
    "qwen2": "<|im_start|>user\nWrite a function that reverses a list.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "llama-bpe": "<|start_header_id|>user<|end_header_id|>\n\nWrite a function that reverses a "
    "list.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
}
GENERATE = 24


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def reference(server, model, port, pre):
    proc = subprocess.Popen(
        [server, "-m", model, "-t", "2", "-c", "4096", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            sys.exit(f"llama-server on {model} did not come up")
        records = []
        for text in TEXTS + [CHAT[pre]]:
            ids = post(port, "/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
            # A token at a time: the server leaves out the probabilities of a token that ends
            # inside a UTF-8 character, which would misalign a longer generation's list; such
            # a position's reference is null.
            tokens, tops = [], []
            for _ in range(GENERATE):
                out = post(port, "/completion", {
                    "prompt": ids + tokens, "n_predict": 1, "temperature": 0, "n_probs": 20,
                    "cache_prompt": True, "ignore_eos": True, "post_sampling_probs": False,
                    "return_tokens": True,
                })
                probs = out.get("completion_probabilities", [])
                if len(out["tokens"]) != 1 or len(probs) > 1 or any(p["id"] != out["tokens"][0] for p in probs):
                    sys.exit(f"llama-server gave {out['tokens']} with {len(probs)} probabilities")
                tokens.append(out["tokens"][0])
                tops.append([[t["id"], t["logprob"]] for t in probs[0]["top_logprobs"]] if probs else None)
            records.append({
                "text": text,
                "prompt_token_ids": ids,
                "generated_token_ids": tokens,
                "top_logprobs": tops,
            })
        return records
    finally:
        proc.terminate()
        proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=18181)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, pre in [("qwen3", "qwen2"), ("qwen3moe", "qwen2"), ("llama3", "llama-bpe")]:
        for dtype in ["q8_0", "q4_k_m"]:
            model = os.path.join(args.models, f"{name}.{dtype}.gguf")
            if not os.path.exists(model):
                continue
            with open(model, "rb") as f:
                sha = hashlib.sha256(f.read()).hexdigest()
            print(f"llama.cpp on {model}", file=sys.stderr, flush=True)
            records = reference(args.server, model, args.port, pre)
            with open(os.path.join(args.out, f"{name}.{dtype}.json"), "w") as f:
                json.dump({"file": f"{name}.{dtype}.gguf", "sha256": sha, "records": records}, f)
                f.write("\n")


if __name__ == "__main__":
    main()
