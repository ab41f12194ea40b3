#!/usr/bin/env python3
"""Renders conversations with Qwen3's and Llama 3.1's chat templates the way Hugging Face's
`apply_chat_template` does (Jinja2 sandboxed, trim_blocks and lstrip_blocks, `tojson` as
`json.dumps(ensure_ascii=False)`, `raise_exception`), for engine/tests/synthetic.rs to compare
Tandem's rendering with. No `strftime_now`: Tandem defines no clock for templates (a prompt that
changes with the date would defeat prefix caches), so Llama 3.1's renders its default date.

Usage: template_reference.py --vocab-dir DIR --out FILE
"""

import argparse
import json
import os

from jinja2.sandbox import ImmutableSandboxedEnvironment

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
CONVERSATIONS = [
    ("a user turn", [{"role": "user", "content": "Hello!"}], None),
    ("a system prompt and a turn with its reasoning", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ], None),
    ("a tool round trip", [
        {"role": "user", "content": "Weather in Paris? ünïcode"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temperature_c\": 18}", "tool_call_id": "call_0"},
    ], TOOLS),
]


def render(template, messages, tools, bos, eos):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise ValueError(message)

    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True,
        bos_token=bos, eos_token=eos,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = {}
    for model, name, bos, eos in [
        ("qwen3", "Qwen-Qwen3-0.6B.jinja", "<|endoftext|>", "<|im_end|>"),
        ("llama3", "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ]:
        with open(os.path.join(args.vocab_dir, name), encoding="utf-8") as f:
            template = f.read()
        out[model] = [
            {"name": n, "messages": m, "tools": t or [], "rendered": render(template, m, t, bos, eos)}
            for n, m, t in CONVERSATIONS
        ]
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
