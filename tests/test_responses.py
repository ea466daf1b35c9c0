"""POST /v1/responses (OpenAI's Responses API) through the real `openai` SDK against one real
server: text, streaming (the SDK's stream helper and its final response), instructions,
max_output_tokens, function tools forced and round-tripped, JSON schemas, and refusals in
OpenAI's error shape. The streamed items' construction (reasoning, tool calls) is also fed
text directly, with no server."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from servelm.sampling_params import SamplingParams
from servelm.server.responses import StreamedItems, _Events, answer_items
from servelm.server.serving import Prepared
from servelm.server.tools import HermesParser
from tests.test_server import Server

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}},
    {"type": "function", "name": "get_time", "description": "The time in a time zone",
     "parameters": {"type": "object",
                    "properties": {"zone": {"type": "string"}, "hour24": {"type": "boolean"}},
                    "required": ["zone", "hour24"]}},
]


@pytest.fixture(scope="module")
def server():
    s = Server("--kernel-tuning", "off")
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def greedy(**kw):
    return {"model": MODEL, "temperature": 0, **kw}


def streamed(client: openai.OpenAI, final: bool = True, **kw):
    """The stream's events and the SDK's final response (which needs response.completed)."""
    with client.responses.stream(**greedy(**kw)) as stream:
        events = list(stream)
        return events, stream.get_final_response() if final else None


def test_create_text(client):
    r = client.responses.create(**greedy(input=QUESTION, max_output_tokens=40))
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.completed_at and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    assert "Paris" in r.output_text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 40
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    # The request's parameters, echoed as the SDK's Response carries them.
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0, 1, 40)
    assert (r.tool_choice, r.tools, r.parallel_tool_calls) == ("auto", [], True)
    assert r.text.format.type == "text" and r.store is False


def _wire(server, kw) -> tuple[httpx.Response, str]:
    with httpx.stream("POST", f"{server.url}/v1/responses",
                      json=greedy(stream=True, **kw), timeout=120) as r:
        return r, r.read().decode()


def test_stream_equals_create(client, server):
    kw = {"input": QUESTION, "max_output_tokens": 40}
    with ThreadPoolExecutor(2) as pool:  # the three at once: one batch, not three in turn
        in_stream = pool.submit(streamed, client, **kw)
        on_wire = pool.submit(_wire, server, kw)
        plain = client.responses.create(**greedy(**kw))
        (events, final), (r, body) = in_stream.result(), on_wire.result()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    text = "".join(e.delta for e in deltas)
    assert text == plain.output_text == final.output_text
    assert final.id == events[0].response.id and final.status == "completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and done.item_id == final.output[0].id
    assert final.usage.output_tokens == plain.usage.output_tokens
    # On the wire: OpenAI's framing (the event name, then its data), no [DONE].
    assert r.headers["content-type"].startswith("text/event-stream")
    assert body.startswith("event: response.created\ndata: {")
    assert "[DONE]" not in body and body.rstrip().split("\n")[-2] == "event: response.completed"


def test_instructions_are_the_system_message(client):
    """instructions lead the conversation, as a developer message there would."""
    kw = {"max_output_tokens": 24}
    asks = [dict(input=QUESTION, max_output_tokens=1),  # its prompt's length only
            dict(input=QUESTION, instructions="Answer in French.", **kw),
            dict(input=[{"role": "developer", "content": "Answer in French."},
                        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                 **kw)]
    with ThreadPoolExecutor(len(asks)) as pool:  # at once: one batch, not three in turn
        bare, told, as_item = pool.map(lambda a: client.responses.create(**greedy(**a)), asks)
    assert told.instructions == "Answer in French."
    assert told.usage.input_tokens != bare.usage.input_tokens  # the default system prompt goes
    assert told.usage.input_tokens == as_item.usage.input_tokens
    assert told.output_text == as_item.output_text


def test_max_output_tokens_incomplete(client):
    kw = {"input": "Write a long story about the sea.", "max_output_tokens": 5}
    r = client.responses.create(**greedy(**kw))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.completed_at is None and r.usage.output_tokens == 5
    assert r.output[-1].status == "incomplete" and r.output_text
    events, _ = streamed(client, final=False, **kw)
    assert events[-1].type == "response.incomplete"
    last = events[-1].response
    assert last.incomplete_details.reason == "max_output_tokens"
    assert last.output_text == r.output_text and last.usage.output_tokens == 5
    assert events[-2].type == "response.output_item.done"
    assert events[-2].item.status == "incomplete"


def _calls(response) -> list:
    return [o for o in response.output if o.type == "function_call"]


def test_tool_choice_required(client):
    kw = {"input": "What is the weather in Paris?", "tools": TOOLS[:1],
          "tool_choice": "required"}
    with ThreadPoolExecutor(1) as pool:  # whole and streamed at once: one batch
        in_stream = pool.submit(streamed, client, **kw)
        r = client.responses.create(**greedy(**kw))
        events, final = in_stream.result()
    (call,) = _calls(r)
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather"
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_text.delta" not in kinds
    (added,) = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call" and added.item.arguments == ""
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments == _calls(final)[0].arguments
    assert "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta") == call.arguments


def test_named_tool_choice(client):
    """A named function is called, with arguments its schema accepts, whichever the model
    would rather call; allowed_tools restricts the tools offered."""
    r = client.responses.create(**greedy(
        input="What is the weather in Paris?", tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"}))
    (call,) = _calls(r)
    args = json.loads(call.arguments)
    assert call.name == "get_time" and set(args) == {"zone", "hour24"}
    assert isinstance(args["zone"], str) and isinstance(args["hour24"], bool)
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_time"
    r = client.responses.create(**greedy(
        input="What time is it in Tokyo?", tools=TOOLS, tool_choice={
            "type": "allowed_tools", "mode": "required",
            "tools": [{"type": "function", "name": "get_weather"}]}))
    assert [c.name for c in _calls(r)] == ["get_weather"]


def test_function_call_output_round_trip(client):
    """The output items go back as input with the call's result: the answer reads it."""
    conversation = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(**greedy(input=conversation, tools=TOOLS[:1],
                                             tool_choice="required"))
    (call,) = _calls(first)
    conversation += first.output
    conversation.append({"type": "function_call_output", "call_id": call.call_id,
                         "output": json.dumps({"city": "Paris", "temperature_c": 21})})
    second = client.responses.create(**greedy(input=conversation, tools=TOOLS[:1],
                                              max_output_tokens=60))
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    conversation += second.output
    conversation.append({"role": "user", "content": "Thanks."})
    # Streamed (asked at once, one batch), the same conversation gives the same answer.
    with ThreadPoolExecutor(1) as pool:
        in_stream = pool.submit(streamed, client, final=False, input=conversation,
                                tools=TOOLS[:1], max_output_tokens=8)
        third = client.responses.create(**greedy(input=conversation, tools=TOOLS[:1],
                                                 max_output_tokens=8))
        events, _ = in_stream.result()
    assert third.usage.input_tokens > second.usage.input_tokens
    last = events[-1].response
    assert last.status == third.status and last.output_text == third.output_text
    assert [o.type for o in last.output] == [o.type for o in third.output]


def test_json_schema_format(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "age": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema}}
    r = client.responses.create(**greedy(input="Describe a person.", text=fmt,
                                         max_output_tokens=100))
    assert r.status == "completed"
    data = json.loads(r.output_text)
    assert set(data) == {"name", "age"} and isinstance(data["name"], str)
    assert isinstance(data["age"], int) and len(data["name"]) <= 16
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


@pytest.mark.parametrize("fields, param, words", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "built-in tool 'web_search'"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type",
     "built-in tool 'file_search'"),
    ({"input": [{"type": "bogus"}]}, "input[0].type", "'bogus'"),
    ({"input": [{"role": "user"}]}, "input[0].content", "required"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "'user'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
     "required"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "x"}]},
     "input[0].call_id", "no function_call item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "text only"),
    ({"input": []}, "input", "empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "'nope'"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object",
                                     "properties": {"a": {"type": "nonsense"}}}}}},
     "text.format.schema", "nonsense"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "name"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than"),
    ({"temperature": 3}, "temperature", "less than"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"background": True}, "background", "not supported"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"frequency_penalty": 1}, "frequency_penalty", "unknown field"),
])
def test_refused_in_openais_shape(client, server, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", extra_body=fields)
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]


def test_errors_on_the_wire_and_still_serving(client, server):
    r = httpx.post(f"{server.url}/v1/responses",
                   json={"model": MODEL, "input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "gpt-5", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_123")
    assert "ResponsesRequest" in httpx.get(f"{server.url}/openapi.json").json()["components"][
        "schemas"]
    assert "keeps no responses" in e.value.body["message"]
    ok = client.responses.create(**greedy(input=QUESTION, max_output_tokens=8))
    assert ok.status in ("completed", "incomplete") and ok.output_text
    # Metadata and policy fields are accepted and echoed, with no effect on the answer.
    same = client.responses.create(**greedy(
        input=QUESTION, max_output_tokens=8, metadata={"k": "v"}, user="u", store=False,
        safety_identifier="s", prompt_cache_key="p", service_tier="auto",
        parallel_tool_calls=False, reasoning={"effort": "low"},
        include=["reasoning.encrypted_content"]))
    assert same.output_text == ok.output_text
    assert same.metadata == {"k": "v"} and same.parallel_tool_calls is False


# ---- the streamed items, fed text directly (no server) ----------------------------------------


def _prepared(tools: bool = False, reasoning: str | None = None) -> Prepared:
    prepared = Prepared([("", [])], SamplingParams(), {},
                        HermesParser(frozenset({"f"})) if tools else None)
    if reasoning is not None:
        parsers = pytest.importorskip("servelm.server.reasoning")
        prepared.reasoning_parser = parsers.parser_for_template(reasoning, None)
    return prepared


def _run(prepared: Prepared, pieces: list[str]) -> tuple[list[dict], list]:
    events = _Events()
    items = StreamedItems(prepared, events)
    out = []
    for i, piece in enumerate(pieces):
        out += items.feed(piece, final=i == len(pieces) - 1)
    out += items.finish(incomplete=False)
    return [json.loads(e.split("\ndata: ", 1)[1]) for e in out], items.items


def _shape(items: list) -> list[dict]:
    return [i.model_dump(exclude={"id", "call_id"}) for i in items]


@pytest.mark.parametrize("text", [
    "<think>The user asks. Paris.</think>\n\nParis is the capital.",
    'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    '<think>\nA call.\n</think>\n<tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>'
    '<tool_call>{"name": "f", "arguments": {"x": 3}}</tool_call>',
    "",
])
def test_streamed_items_match_the_whole_answer(text):
    """In any chunking, the streamed items are what the whole answer makes, and the events
    add up to them."""
    prepared = _prepared(tools=True, reasoning="qwen3")
    whole = answer_items(prepared, text)
    for size in (1, 3, 7, len(text) or 1):
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        events, items = _run(_prepared(tools=True, reasoning="qwen3"), pieces)
        assert _shape(items) == _shape(whole)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [i.type for i in whole]
        for kind, item_type in (("reasoning_text", "reasoning"), ("output_text", "message")):
            delta = "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta")
            done = [e["text"] for e in events if e["type"] == f"response.{kind}.done"]
            texts = [i.content[0].text for i in whole if i.type == item_type]
            assert done == texts and delta == "".join(texts)


def test_reasoning_item_from_a_thought():
    prepared = _prepared(reasoning="qwen3")
    (thought, message) = answer_items(prepared, "<think> Two and two. </think>\n\nFour.")
    assert thought.type == "reasoning" and thought.content[0].text == "Two and two."
    assert message.type == "message" and message.content[0].text == "Four."
