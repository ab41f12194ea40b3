"""Chat with Tandem through the official `openai` package (pip install openai).

Usage: python openai_chat.py [BASE_URL]   (default http://127.0.0.1:8000/v1, `tandem up`'s)
"""

import sys

import openai

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
# Tandem checks no key unless one is configured; the package wants one anyway.
client = openai.OpenAI(base_url=base_url, api_key="none")
model = client.models.list().data[0].id

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=48,
    temperature=0.2,
    top_p=0.9,
    seed=7,
    # Tandem's extension beyond OpenAI's parameters: llama.cpp's repetition penalty.
    extra_body={"repetition_penalty": 1.1},
    # Keeps a conversation's turns on the replica that holds its prefix.
    extra_headers={"x-session-id": "example-1"},
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        u = chunk.usage
        print(f"\n[{u.prompt_tokens} prompt tokens ({u.prompt_tokens_details.cached_tokens} cached), "
              f"{u.completion_tokens} completion tokens]")
