"""Drives tool calling and structured outputs on Tandem's OpenAI-compatible HTTP API with the
official `openai` package, against a cluster serving a model whose chat template takes tools
(the 0.5B Qwen2.5-Coder).

Usage: qwen_check.py BASE_URL (e.g. http://127.0.0.1:8000/v1)

Every check asserts; the script exits non-zero on the first failure and prints one JSON line of
what it saw on success, which `integration-tests/tests/openai_api.rs` checks.
"""

import json
import sys

import openai
import pydantic

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
model = client.models.list().data[0].id
seen = {}

weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
clock = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
common = dict(model=model, temperature=0, max_tokens=64, user="tools-check")

# A required call: the reply is a call of one of the tools, its arguments a JSON object.
chat = client.chat.completions.create(
    messages=question, tools=[weather, clock], tool_choice="required", **common
)
choice = chat.choices[0]
assert choice.finish_reason == "tool_calls", choice
assert choice.message.content is None, choice.message
calls = choice.message.tool_calls
assert calls and len(calls) >= 1, choice.message
call = calls[0]
assert call.type == "function" and call.id, call
assert call.function.name in ("get_weather", "get_time"), call
arguments = json.loads(call.function.arguments)
assert isinstance(arguments, dict), call.function.arguments
seen["required"] = {"name": call.function.name, "arguments": arguments}

# The same request streamed: the call arrives as delta.tool_calls and matches.
streamed = {}
finish = None
for chunk in client.chat.completions.create(
    messages=question, tools=[weather, clock], tool_choice="required", stream=True, **common
):
    c = chunk.choices[0]
    assert not c.delta.content, c.delta
    for d in c.delta.tool_calls or []:
        s = streamed.setdefault(d.index, {"name": "", "arguments": ""})
        s["name"] += d.function.name or ""
        s["arguments"] += d.function.arguments or ""
    finish = c.finish_reason or finish
assert finish == "tool_calls", finish
assert streamed[0]["name"] == call.function.name, streamed
assert json.loads(streamed[0]["arguments"]) == arguments, streamed

# A named function: the call is of that function.
named = client.chat.completions.create(
    messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
    tools=[weather, clock],
    tool_choice={"type": "function", "function": {"name": "get_time"}},
    **common,
)
named_call = named.choices[0].message.tool_calls[0]
assert named_call.function.name == "get_time", named_call
assert isinstance(json.loads(named_call.function.arguments), dict), named_call
seen["named"] = json.loads(named_call.function.arguments)

# The follow-up turn: the call and its result in the history, answered in text, and the
# prompt up to the call comes from a cache.
follow = client.chat.completions.create(
    messages=question
    + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments,
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."},
    ],
    tools=[weather, clock],
    **common,
)
answer = follow.choices[0]
assert follow.usage.prompt_tokens_details.cached_tokens > 0, follow.usage
seen["follow_up"] = {
    "content": answer.message.content,
    "finish": answer.finish_reason,
    "cached": follow.usage.prompt_tokens_details.cached_tokens,
}
assert answer.message.content or answer.message.tool_calls, answer

# tool_choice none: the tools are not offered, the answer is text.
none = client.chat.completions.create(
    messages=question, tools=[weather], tool_choice="none", **common
)
assert none.choices[0].message.tool_calls is None, none.choices[0].message
assert none.choices[0].message.content, none.choices[0].message
assert none.choices[0].finish_reason in ("stop", "length"), none.choices[0]

# Refused by name, before any work.
def refused(param, **kwargs):
    try:
        client.chat.completions.create(**{**common, "messages": question, **kwargs})
    except openai.BadRequestError as e:
        assert param in str(e), (param, str(e))
        return
    raise AssertionError(f"{param} was not refused")

# A strict tool in a forced call: the arguments follow its schema (an enum the question does
# not name included).
strict = json.loads(json.dumps(weather))
strict["function"]["strict"] = True
strict["function"]["parameters"]["properties"]["unit"] = {"enum": ["celsius", "fahrenheit"]}
strict["function"]["parameters"]["required"] = ["city", "unit"]
strict["function"]["parameters"]["additionalProperties"] = False
forced = client.chat.completions.create(
    messages=question, tools=[strict], tool_choice="required", **common
)
forced_args = json.loads(forced.choices[0].message.tool_calls[0].function.arguments)
assert set(forced_args) == {"city", "unit"}, forced_args
assert forced_args["unit"] in ("celsius", "fahrenheit"), forced_args
seen["strict"] = forced_args
# Without a forced call, strict arguments are not guaranteed: refused by name.
refused("strict", tools=[strict])
refused(
    "tool_choice",
    tools=[weather],
    tool_choice={"type": "function", "function": {"name": "nope"}},
)
refused("tool_call_id", messages=question + [{"role": "tool", "content": "x"}])
refused("tool_choice", tool_choice="required")

# Structured outputs: a JSON schema, as `parse` sends it from a pydantic model (strict).
class Cat(pydantic.BaseModel):
    name: str
    age: int
    indoor: bool


cat_question = [
    {"role": "user", "content": "Describe a cat as JSON: its name, age and whether it lives indoors."}
]
parsed = client.chat.completions.parse(
    model=model, messages=cat_question, response_format=Cat, temperature=0, max_tokens=96
)
cat = parsed.choices[0].message.parsed
assert isinstance(cat, Cat), parsed.choices[0].message
assert parsed.choices[0].finish_reason == "stop", parsed.choices[0]
seen["cat"] = cat.model_dump()

# Twenty seeded samples at temperature 0.8, at once: every one parses.
from concurrent.futures import ThreadPoolExecutor


def sample_cat(seed):
    r = client.chat.completions.parse(
        model=model,
        messages=cat_question,
        response_format=Cat,
        temperature=0.8,
        seed=seed,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(r.choices[0].message.parsed, Cat), r.choices[0].message
    return r.choices[0].message.parsed.name


with ThreadPoolExecutor(max_workers=10) as pool:
    seen["sampled_cat_names"] = sorted(set(pool.map(sample_cat, range(20))))

# n = 3: three replies to one prompt, each valid; the first is the one-choice reply with the
# same seed; usage counts the prompt once and every choice's tokens; streamed, each choice's
# deltas join to its text.
cat_schema = {
    "type": "json_schema",
    "json_schema": {"name": "Cat", "schema": Cat.model_json_schema(), "strict": True},
}
sampled = dict(
    model=model,
    messages=cat_question,
    temperature=0.8,
    seed=11,
    max_tokens=200,
)
three = client.chat.completions.parse(response_format=Cat, n=3, logprobs=True, **sampled)
assert [c.index for c in three.choices] == [0, 1, 2], three.choices
for c in three.choices:
    assert c.finish_reason == "stop", c
    assert isinstance(c.message.parsed, Cat), c.message
one = client.chat.completions.parse(response_format=Cat, **sampled)
assert three.choices[0].message.content == one.choices[0].message.content, (three, one)
assert three.usage.prompt_tokens == one.usage.prompt_tokens, (three.usage, one.usage)
tokens = [len(c.logprobs.content) for c in three.choices]
assert three.usage.completion_tokens == sum(tokens), (three.usage, tokens)
streamed = ["", "", ""]
for chunk in client.chat.completions.create(
    response_format=cat_schema, n=3, stream=True, **sampled
):
    for c in chunk.choices:
        streamed[c.index] += c.delta.content or ""
assert streamed == [c.message.content for c in three.choices], streamed
seen["three_cats"] = [c.message.parsed.name for c in three.choices]

# ignore_eos runs to exactly max_tokens.
long = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hi."}],
    max_tokens=40,
    temperature=0,
    extra_body={"ignore_eos": True},
)
assert long.usage.completion_tokens == 40, long.usage
assert long.choices[0].finish_reason == "length", long.choices[0]

# The same schema streamed: the text joins to the same object.
text = "".join(
    c.choices[0].delta.content or ""
    for c in client.chat.completions.create(
        model=model,
        messages=cat_question,
        response_format=cat_schema,
        temperature=0,
        max_tokens=96,
        stream=True,
    )
    if c.choices
)
assert Cat.model_validate_json(text) == cat, text

# Any JSON object: the reply parses to one.
obj = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Give me a short JSON object with the name and country of Paris."}],
    response_format={"type": "json_object"},
    temperature=0,
    max_tokens=200,
)
assert obj.choices[0].finish_reason == "stop", obj.choices[0]
assert isinstance(json.loads(obj.choices[0].message.content), dict), obj.choices[0]
seen["json_object"] = obj.choices[0].message.content

# A schema the engine cannot compile: 400 before any work.
refused(
    "grammar",
    response_format={
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}},
    },
)

print(json.dumps(seen))
