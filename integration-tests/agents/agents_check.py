"""The agent-facing APIs driven by their official clients: Anthropic's Messages API through the
`anthropic` package, OpenAI's Responses API through the `openai` package, and an agent of the
OpenAI Agents SDK with a function tool. Usage: agents_check.py BASE_URL MODEL (BASE_URL without
`/v1`). Every check asserts; the last line printed is a JSON object of what was seen, which the
Rust test compares with what the gRPC API answers.
"""

import json
import sys

import anthropic
import openai

BASE, MODEL = sys.argv[1], sys.argv[2]
seen = {}

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city's name."}},
        "required": ["city"],
    },
}
QUESTION = "What is the capital of France?"
# Anthropic's package no longer takes sampling arguments (its models fix them), but the Messages
# API still does, and Claude Code sends them: greedy decoding makes the replies comparable.
GREEDY = {"temperature": 0}


def check_anthropic():
    client = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": QUESTION}]

    plain = client.messages.create(model=MODEL, max_tokens=24, messages=ask, extra_body=GREEDY)
    assert plain.type == "message" and plain.role == "assistant", plain
    assert plain.content and plain.content[0].type == "text", plain
    assert plain.stop_reason in ("end_turn", "max_tokens"), plain
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0, plain.usage
    seen["anthropic_text"] = plain.content[0].text
    seen["anthropic_prompt_tokens"] = (
        plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)
    )

    # Streamed, the same prompt again: the same text, and the prompt read from the cache.
    names = []
    with client.messages.stream(
        model=MODEL, max_tokens=24, messages=ask, extra_body=GREEDY
    ) as stream:
        for event in stream:
            names.append(event.type)
        streamed = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert "content_block_delta" in names and "message_delta" in names, names
    assert streamed.content[0].text == plain.content[0].text, (streamed, plain)
    assert streamed.usage.cache_read_input_tokens > 0, streamed.usage
    seen["anthropic_stream_cached"] = streamed.usage.cache_read_input_tokens

    counted = client.messages.count_tokens(model=MODEL, messages=ask)
    assert counted.input_tokens == seen["anthropic_prompt_tokens"], counted
    with_tools = client.messages.count_tokens(model=MODEL, messages=ask, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens, with_tools

    # A forced tool call, then its result back.
    paris = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    forced = client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=paris,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert forced.stop_reason == "tool_use", forced
    use = [b for b in forced.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather", forced
    assert isinstance(use[0].input.get("city"), str), use[0]
    seen["anthropic_tool_input"] = use[0].input
    answer = client.messages.create(
        model=MODEL,
        max_tokens=48,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=paris
        + [
            {"role": "assistant", "content": [b.model_dump() for b in forced.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use[0].id,
                        "content": "Sunny, 24 degrees Celsius.",
                    }
                ],
            },
        ],
    )
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use"), answer
    assert text or answer.stop_reason == "tool_use", answer
    seen["anthropic_tool_answer"] = text

    # A streamed tool call: its input arrives as input_json_delta.
    deltas = []
    with client.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=paris,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                deltas.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use", final
    call = [b for b in final.content if b.type == "tool_use"][0]
    assert json.loads("".join(deltas)) == call.input, (deltas, call)

    # A stop sequence ends the reply and is named.
    counting = client.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body=GREEDY,
        stop_sequences=["5"],
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
    )
    assert counting.stop_reason == "stop_sequence", counting
    assert counting.stop_sequence == "5", counting
    assert "5" not in counting.content[0].text, counting

    # Refusals: Anthropic's error shapes and statuses.
    try:
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
        raise AssertionError("an image block was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error", e.body
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert "image" in e.body["error"]["message"], e.body
    try:
        client.messages.create(model="gpt-4o", max_tokens=8, messages=ask)
        raise AssertionError("an unknown model was accepted")
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body


def check_responses():
    client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0)
    plain = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0
    )
    assert plain.object == "response" and plain.status in ("completed", "incomplete"), plain
    assert plain.output_text, plain
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0, plain.usage
    seen["responses_text"] = plain.output_text

    kinds = []
    text = ""
    completed = None
    for event in client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0, stream=True
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds, kinds
    assert text == plain.output_text and completed.output_text == text, (text, completed)
    assert completed.usage.input_tokens_details.cached_tokens > 0, completed.usage
    numbers = []
    with client.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0
    ) as stream:
        for event in stream:
            numbers.append(event.sequence_number)
        final = stream.get_final_response()
    assert numbers == list(range(len(numbers))), numbers
    assert final.output_text == plain.output_text, final

    # A function call and its output back.
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    }
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    called = client.responses.create(
        model=MODEL,
        input=ask,
        tools=[tool],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", called
    arguments = json.loads(calls[0].arguments)
    assert isinstance(arguments.get("city"), str), arguments
    seen["responses_tool_arguments"] = arguments
    answer = client.responses.create(
        model=MODEL,
        input=ask
        + [o.model_dump(exclude_none=True) for o in called.output]
        + [
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": "Sunny, 24 degrees Celsius.",
            }
        ],
        tools=[tool],
        max_output_tokens=48,
        temperature=0,
    )
    assert answer.output, answer
    seen["responses_tool_answer"] = answer.output_text

    try:
        client.responses.create(model=MODEL, input=QUESTION, store=True)
        raise AssertionError("store: true was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "store", e.body
    try:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id=plain.id)
        raise AssertionError("previous_response_id was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "previous_response_id", e.body


def weather_agent(settings):
    """An agent whose get_weather tool records the cities it is asked about."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool

    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"It is sunny and 24 degrees Celsius in {city}."

    client = openai.AsyncOpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the get_weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(**settings),
    )
    return agent, cities


def check_agent():
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)
    # The first turn must call the tool; the SDK then resets the choice to auto, and the model
    # answers from the tool's result.
    agent, cities = weather_agent(dict(tool_choice="required", temperature=0, max_tokens=64))
    result = Runner.run_sync(agent, "What is the weather like in Paris today?", max_turns=6)
    assert cities, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output.strip(), result
    seen["agent_cities"] = cities
    seen["agent_answer"] = result.final_output


def check_agent_on_auto():
    """The same agent with the SDK's defaults (tool_choice auto): the small model writes its
    call as bare JSON, without its template's tags, and the call must still reach the tool."""
    from agents import Runner

    agent, cities = weather_agent(dict(temperature=0, max_tokens=128))
    Runner.run_sync(agent, "What is the weather like in Paris today?", max_turns=6)
    assert cities == ["Paris"], f"the agent on auto called its tool for {cities}"
    seen["agent_on_auto_cities"] = cities


check_anthropic()
check_responses()
check_agent()
check_agent_on_auto()
print(json.dumps(seen))
