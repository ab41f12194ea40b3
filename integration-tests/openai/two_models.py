"""Drives a Tandem cluster serving two models with the official `openai` package.

Usage: two_models.py BASE_URL (e.g. http://127.0.0.1:8000/v1)

Lists the models, gives each one the same prompt (completions, greedy, plain and streamed: Gemma
3 270M's file has no chat template), and asks for an unknown model; asserts what the client sees and prints one JSON line of it, which
`integration-tests/tests/openai_api.rs` checks against the gRPC API and the nodes' metrics.
"""

import json
import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
seen = {"replies": {}}

ids = [m.id for m in client.models.list().data]
assert len(ids) == 2, ids
seen["models"] = ids

prompt = "The colours of the rainbow are red, orange,"
for model in ids:
    done = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert done.model == model, (done.model, model)
    text = done.choices[0].text
    assert text, done
    # Streamed, the same model answers the same.
    streamed = ""
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
    ):
        assert chunk.model == model, (chunk.model, model)
        if chunk.choices:
            streamed += chunk.choices[0].text
    assert streamed == text, (streamed, text)
    seen["replies"][model] = text

try:
    client.completions.create(model="gpt-4o", prompt=prompt, max_tokens=4)
    raise AssertionError("an unknown model was served")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
    for model in ids:
        assert model in e.body["message"], e.body
    seen["unknown_status"] = e.status_code

print(json.dumps(seen))
