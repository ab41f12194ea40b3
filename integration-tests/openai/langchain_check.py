"""Drives Tandem's OpenAI-compatible HTTP API through LangChain's `ChatOpenAI`, as agent
frameworks do: `with_structured_output` with a pydantic model, and `bind_tools` for a tool call
round trip (the call, the tool's result, the final answer), invoked and streamed.

Usage: langchain_check.py BASE_URL (e.g. http://127.0.0.1:8000/v1)

Every check asserts; the script exits non-zero on the first failure and prints one JSON line of
what it saw on success.
"""

import json
import sys

import pydantic
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

base_url = sys.argv[1]
seen = {}
llm = ChatOpenAI(
    base_url=base_url,
    api_key="unused",
    model="unused",
    temperature=0,
    max_tokens=128,
    max_retries=0,
    timeout=120,
)
# The model's own name, as a client reads it from /v1/models.
llm.model_name = llm.root_client.models.list().data[0].id


class Cat(pydantic.BaseModel):
    """A cat."""

    name: str
    age: int
    indoor: bool


cat = llm.with_structured_output(Cat).invoke(
    "Describe a cat as JSON: its name, age and whether it lives indoors."
)
assert isinstance(cat, Cat), cat
seen["cat"] = cat.model_dump()


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny and 21 degrees Celsius in {city}."


question = HumanMessage("What is the weather like in Paris today?")
forced = llm.bind_tools([get_weather], tool_choice="get_weather")
call = forced.invoke([question])
assert call.tool_calls, call
assert call.tool_calls[0]["name"] == "get_weather", call.tool_calls
assert isinstance(call.tool_calls[0]["args"].get("city"), str), call.tool_calls
seen["call"] = call.tool_calls[0]["args"]

# Streamed, the chunks add up to the same call.
streamed = None
for chunk in forced.stream([question]):
    assert isinstance(chunk, AIMessageChunk), chunk
    streamed = chunk if streamed is None else streamed + chunk
assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in call.tool_calls], (
    streamed.tool_calls,
    call.tool_calls,
)

# The tool's result goes back with the call, and the model answers in text.
result = get_weather.invoke(call.tool_calls[0])
answer = llm.bind_tools([get_weather]).invoke([question, call, result])
assert isinstance(answer.content, str) and answer.content, answer
seen["answer"] = answer.content

print(json.dumps(seen))
