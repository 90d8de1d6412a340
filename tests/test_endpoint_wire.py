"""The agents' endpoint's typed seams: requests parsed into pydantic models (a malformed one is a 400
whose ``error`` names the field, in one line, as OpenAI's is), answers built from ``openai.types``,
and tool calls read by purerl's one Hermes parser (:func:`purerl.episodes.tools.hermes_calls`)."""

import json

import pytest

from purerl.agents import Endpoint, EngineBatcher, EpisodeTraces, tool_calls_of
from purerl.episodes import ChatCodec
from purerl.episodes.tools import hermes_calls, parse_call
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tiny import char_tokenizer
from tests.test_episodes import ScriptedEngine, _text

pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("purerl.agents.openai_requests")

USER = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>'


def test_one_hermes_parser_reads_every_call_and_keeps_malformed_ones_as_text():
    text = f'Let me see. <tool_call>{{not json}}</tool_call> then {CALL} <tool_call>["no", "name"]</tool_call>'
    calls = hermes_calls(text)
    assert [c.name for c in calls] == [None, "calc", None] and calls[0].raw == "{not json}"
    assert text[calls[1].start:calls[1].end] == CALL and calls[1].arguments_json == '{"expression": "3*4"}'
    content, openai_calls = tool_calls_of(text)  # the endpoint: the malformed call before the good one stays text
    assert content == "Let me see. <tool_call>{not json}</tool_call> then"
    assert [c["function"] for c in openai_calls] == [{"name": "calc", "arguments": '{"expression": "3*4"}'}]
    assert parse_call(text, ["calc"], "json") == ("?", '["no", "name"]')  # the env: the call ending the turn
    assert parse_call(f"{CALL} and more", ["calc"], "json") is None
    stringified = '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    assert parse_call(stringified, ["calc"], "json") == ("calc", '{"expression": "1"}')  # OpenAI's string form
    assert tool_calls_of(stringified)[1][0]["function"]["arguments"] == '{"expression": "1"}'


@pytest.mark.parametrize("body, param", [
    ({"model": "policy"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": USER, "max_tokens": -3}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "n": 2.0}, "n"),
    ({"messages": USER, "n": True}, "n"),
    ({"messages": [*USER, {"role": "bot", "content": "x"}]}, "messages[1].role"),
    ({"messages": [*USER, "hi"]}, "messages[1]"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "top_p": 1.5}, "top_p"),
    ({"messages": USER, "stop": 5}, "stop"),
    ({"messages": USER, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"messages": USER, "seed": 1}, "seed"),
])
def test_a_malformed_chat_request_names_its_field(body, param):
    with pytest.raises(requests.RequestError) as raised:
        requests.parsed(requests.ChatRequest, body)
    assert raised.value.param == param and str(raised.value).startswith(param) and "\n" not in str(raised.value)


def test_requests_parse_into_what_the_engine_samples_by():
    asked = requests.parsed(requests.ChatRequest, {"messages": [{"role": "tool", "content": "12", "tool_call_id": "c"}],
                                                   "stop": "x", "max_tokens": 5, "max_completion_tokens": 7,
                                                   "tools": [{"type": "function"}], "unknown_field": 1})
    assert asked.messages[0].as_dict() == {"role": "tool", "content": "12", "tool_call_id": "c"}
    assert asked.stops == ("x",) and asked.asked_tokens == 7 and asked.parses_tools and not asked.include_usage
    assert requests.parsed(requests.ChatRequest, {"messages": USER, "stop": ""}).stops == ()
    prompt = requests.parsed(requests.CompletionRequest, {"prompt": [1, 2], "logprobs": 2})
    assert prompt.prompt == [1, 2] and prompt.logprobs == 2
    with pytest.raises(requests.RequestError, match="^prompt: a string or a list of token ids is required, got"):
        requests.parsed(requests.CompletionRequest, {"prompt": [1, "a"]})
    with pytest.raises(requests.RequestError) as raised:
        requests.parsed_json(requests.ChatRequest, b"[1]")
    assert raised.value.code == "invalid_json"


@pytest.fixture(scope="module")
def endpoint():
    tokenizer = char_tokenizer(chatml=True)
    engine = ScriptedEngine(tokenizer, lambda prompt, k: _text(tokenizer, f"Sure. {CALL}"))
    batcher = EngineBatcher(engine, RngState(0), 0, thread=True)
    traces = EpisodeTraces(ChatCodec(tokenizer), max_turns=4, max_tokens=400)
    with Endpoint(batcher, traces, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                  token_text=lambda t: tokenizer.decode([t]), sampling=SamplingParams(max_new_tokens=90)) as served:
        yield served


@pytest.mark.parametrize("body, param", [({"model": "policy"}, "messages"),
                                         ({"messages": USER, "max_tokens": -1}, "max_tokens")])
def test_a_malformed_request_is_a_400_whose_error_names_the_field(endpoint, body, param):
    calls = endpoint.batcher.calls
    answer = httpx.post(f"{endpoint.url}/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {endpoint.token}"})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and error["message"].startswith(f"{param}: ")
    assert error["type"] == "invalid_request_error" and error["code"] == f"invalid_{param}"
    assert "\n" not in error["message"] and endpoint.batcher.calls == calls  # refused before sampling


def test_answers_are_openais_types_on_the_wire(endpoint):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    auth = {"Authorization": f"Bearer {endpoint.token}"}
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    answer = httpx.post(f"{endpoint.url}/chat/completions", headers=auth,
                        json={"messages": USER, "tools": tools, "n": 2, "logprobs": True}).json()
    chat = ChatCompletion.model_validate(answer)
    assert set(answer) == {"id", "object", "created", "model", "choices", "usage", "prompt_token_ids"}
    for choice in chat.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"expression": "3*4"}
        assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    answer = httpx.post(f"{endpoint.url}/completions", headers=auth, json={"prompt": "ab", "max_tokens": 3}).json()
    text = Completion.model_validate(answer)
    assert set(answer["choices"][0]) == {"index", "finish_reason", "text", "token_ids"}
    assert text.usage.completion_tokens == len(text.choices[0].model_extra["token_ids"]) == 3
    models = httpx.get(f"{endpoint.url}/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["policy"] and models["object"] == "list"
