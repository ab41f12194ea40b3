"""Drives Tandem's OpenAI-compatible HTTP API with the official `openai` package.

Usage: client_check.py BASE_URL (e.g. http://127.0.0.1:8000/v1)

Every check asserts; the script exits non-zero on the first failure and prints one JSON line of
what it saw on success, which `integration-tests/tests/openai_api.rs` reads and checks against
the gRPC API.
"""

import json
import sys
import urllib.request

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
seen = {}

# The model list names the one model; requests use it.
models = client.models.list()
ids = [m.id for m in models.data]
assert len(ids) == 1, ids
model = ids[0]
seen["model"] = model

messages = [{"role": "user", "content": "What is the capital of France?"}]

# Chat, not streamed, greedy and seeded: usage adds up.
chat = client.chat.completions.create(
    model=model, messages=messages, max_tokens=24, temperature=0, seed=1
)
choice = chat.choices[0]
assert choice.message.role == "assistant", choice
assert choice.finish_reason in ("stop", "length"), choice
assert chat.object == "chat.completion", chat.object
u = chat.usage
assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
assert 0 < u.completion_tokens <= 24, u
seen["chat_text"] = choice.message.content
seen["chat_usage"] = {"prompt": u.prompt_tokens, "completion": u.completion_tokens}

# The same request streamed: the deltas join to the same text, then usage comes last.
streamed_chat = dict(model=model, messages=messages, max_tokens=24, temperature=0, seed=1, stream=True)
stream = client.chat.completions.create(**streamed_chat, stream_options={"include_usage": True})
parts, finish, usage = [], None, None
for chunk in stream:
    assert chunk.object == "chat.completion.chunk", chunk
    if chunk.usage is not None:
        assert chunk.choices == [], chunk
        usage = chunk.usage
        continue
    c = chunk.choices[0]
    if c.delta.content:
        parts.append(c.delta.content)
    if c.finish_reason:
        finish = c.finish_reason
assert "".join(parts) == seen["chat_text"], (parts, seen["chat_text"])
assert finish == choice.finish_reason, finish
assert usage is not None and usage.completion_tokens == u.completion_tokens, usage
# Cached prompt tokens are reported (the second identical prompt hits a cache).
assert usage.prompt_tokens_details is not None, usage
seen["stream_cached_tokens"] = usage.prompt_tokens_details.cached_tokens

# vLLM's continuous usage (as guidellm asks for it): every chunk has the usage so far, the
# prompt's tokens from the first, the reply's growing to the total.
counted = []
for chunk in client.chat.completions.create(
    **streamed_chat,
    stream_options={"include_usage": True, "continuous_usage_stats": True},
):
    assert chunk.usage is not None, chunk
    assert chunk.usage.prompt_tokens == u.prompt_tokens, chunk.usage
    counted.append(chunk.usage.completion_tokens)
assert counted == sorted(counted) and counted[0] == 0, counted
assert counted[-1] == u.completion_tokens, counted

# Completions, streamed and not, agree.
prompt = "The list of the first ten prime numbers: 2, 3, 5,"
comp = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
assert comp.object == "text_completion", comp.object
text = comp.choices[0].text
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
    )
    if c.choices
)
assert streamed == text, (streamed, text)
seen["completion_text"] = text

# A stop sequence ends the text before it, with finish_reason "stop".
assert len(text) > 4, text
stop_at = text[2:4]
cut = client.completions.create(
    model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop_at]
)
assert cut.choices[0].text == text[: text.index(stop_at)], (cut.choices[0].text, stop_at)
assert cut.choices[0].finish_reason == "stop", cut.choices[0]

# Penalties change what is sampled (and are deterministic).
loopy = "Repeat after me: the cat, the cat, the cat, the cat,"
plain = client.completions.create(model=model, prompt=loopy, max_tokens=24, temperature=0)
penalized = [
    client.completions.create(
        model=model,
        prompt=loopy,
        max_tokens=24,
        temperature=0,
        frequency_penalty=1.5,
        presence_penalty=1.0,
        extra_body={"repetition_penalty": 1.3},
    ).choices[0].text
    for _ in range(2)
]
assert penalized[0] == penalized[1], penalized
assert penalized[0] != plain.choices[0].text, (penalized[0], plain.choices[0].text)
seen["penalized"] = [plain.choices[0].text, penalized[0]]

# Seeded sampling repeats itself.
sampled = [
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0.8, top_p=0.9, seed=7
    ).choices[0].message.content
    for _ in range(2)
]
assert sampled[0] == sampled[1], sampled

# What benchmark clients send to fix the output length: ignore_eos gives exactly max_tokens;
# min_tokens at least that many (the greedy chat reply above ends sooner).
short = seen["chat_usage"]["completion"]
fixed = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=short + 20,
    temperature=0,
    extra_body={"ignore_eos": True},
)
assert fixed.usage.completion_tokens == short + 20, fixed.usage
assert fixed.choices[0].finish_reason == "length", fixed.choices[0]
longer = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=short + 40,
    temperature=0,
    extra_body={"min_tokens": short + 10},
)
assert longer.usage.completion_tokens >= short + 10, longer.usage
# A logit bias of +100 makes token 42 the greedy choice at every position; listed in
# stop_token_ids, it then ends the reply at once. min_p 1 keeps only the most likely token,
# so sampling is greedy whatever the temperature, with top_k beside it.
biased = client.completions.create(
    model=model, prompt=prompt, max_tokens=4, temperature=0, logit_bias={"42": 100}
)
assert biased.usage.completion_tokens == 4, biased.usage
assert biased.choices[0].text != text, biased.choices[0].text
stopped = client.completions.create(
    model=model,
    prompt=prompt,
    max_tokens=4,
    temperature=0,
    logit_bias={"42": 100},
    extra_body={"stop_token_ids": [42]},
)
assert stopped.usage.completion_tokens == 0, stopped.usage
assert stopped.choices[0].finish_reason == "stop", stopped.choices[0]
hot_but_greedy = client.completions.create(
    model=model, prompt=prompt, max_tokens=16, temperature=1.5, seed=3,
    extra_body={"min_p": 1.0, "top_k": 40},
)
assert hot_but_greedy.choices[0].text == text, (hot_but_greedy.choices[0].text, text)

# A parameter Tandem does not support is rejected by name.
try:
    client.completions.create(model=model, prompt=prompt, max_tokens=4, best_of=2)
    raise AssertionError("best_of=2 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e
    assert "'best_of'" in e.message, e.message
    assert e.body["param"] == "best_of", e.body
# SmolLM2's chat template takes no tools: offering some is refused by name.
try:
    client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
    )
    raise AssertionError("tools were accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "tools", e.body
    assert "takes no tools" in e.message, e.message

# Error statuses: an invalid value (400 naming it), an unknown model (404), a deadline (504).
try:
    client.chat.completions.create(model=model, messages=messages, temperature=3)
    raise AssertionError("temperature 3 was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "temperature", e.body
try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
try:
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, extra_headers={"x-timeout-ms": "1"}
    )
    raise AssertionError("a 1 ms deadline was met")
except openai.APIStatusError as e:
    assert e.status_code == 504, e

# The health endpoint, for load balancers.
with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=10) as health:
    assert health.status == 200, health.status

print(json.dumps(seen))
