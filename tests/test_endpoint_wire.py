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
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "top_p": float("nan")}, "top_p"),
    ({"messages": USER, "temperature": float("inf")}, "temperature"),
    ({"messages": USER, "temperature": float("nan")}, "temperature"),
    ({"messages": USER, "temperature": 1e308}, "temperature"),
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "temperature": "0.5"}, "temperature"),
    ({"messages": USER, "stop": ["", "zz"]}, "stop[0]"),
    ({"messages": USER, "stop": ""}, "stop"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "logprobs": "true"}, "logprobs"),
    ({"messages": USER, "stream": 1}, "stream"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url",
                                                "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c"}]}, "messages[1]"),
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
    assert requests.parsed(requests.ChatRequest, {"messages": USER, "stop": None}).stops == ()
    prompt = requests.parsed(requests.CompletionRequest, {"prompt": [1, 2], "logprobs": 1})
    assert prompt.prompt == [1, 2] and prompt.logprobs == 1
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


def test_a_part_the_endpoint_cannot_take_is_refused_naming_its_type():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(requests.RequestError, match="^messages\\[0\\].content: content\\[1\\] is of type 'image_url'"):
        requests.parsed(requests.ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                          image]}]})


@pytest.mark.parametrize("logprobs", [2, 5])
def test_completion_logprobs_asking_for_alternatives_is_refused(logprobs):
    with pytest.raises(requests.RequestError) as raised:
        requests.parsed(requests.CompletionRequest, {"prompt": "a", "logprobs": logprobs})
    assert raised.value.param == "logprobs" and "alternatives" in str(raised.value)


def _posted(endpoint, path, body, **headers):
    auth = {"Authorization": f"Bearer {endpoint.token}", **headers}
    if isinstance(body, bytes):
        return httpx.post(f"{endpoint.url}/{path}", content=body, headers={**auth, "Content-Type": "application/json"})
    return httpx.post(f"{endpoint.url}/{path}", json=body, headers=auth)


def test_text_parts_are_served_as_their_joined_text(endpoint):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "3*4?"}]
    as_parts = _posted(endpoint, "chat/completions", {"messages": [{"role": "user", "content": parts}]})
    as_text = _posted(endpoint, "chat/completions", {"messages": [{"role": "user", "content": "What is\n3*4?"}]})
    assert as_parts.status_code == as_text.status_code == 200, as_parts.text
    assert as_parts.json()["prompt_token_ids"] == as_text.json()["prompt_token_ids"]


@pytest.mark.parametrize("body, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e308}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["", "zz"]}', "stop[0]"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "stop": [""]}', "stop[0]"),
])
def test_sampling_settings_outside_openais_ranges_are_400s_on_the_wire(endpoint, body, param):
    calls = endpoint.batcher.calls
    path = "completions" if b'"prompt"' in body else "chat/completions"
    answer = _posted(endpoint, path, body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert endpoint.batcher.calls == calls


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
@pytest.mark.parametrize("field", ["n", "max_tokens", "max_completion_tokens"])
def test_a_request_past_the_endpoints_limits_is_a_400_naming_the_limit(endpoint, path, field):
    calls = endpoint.batcher.calls
    over = {"n": endpoint.batcher.max_rows + 1}.get(field, endpoint.sampling.max_new_tokens + 1)
    body = {"messages": USER} if path == "chat/completions" else {"prompt": "hi"}
    answer = _posted(endpoint, path, {**body, field: over}, **{"X-Episode-Id": f"over-{path}-{field}"})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == field and f"at most {over - 1}" in error["message"]
    assert ("max_rows" if field == "n" else "rollout.max_new_tokens") in error["message"]
    assert endpoint.batcher.calls == calls and endpoint.traces.pop(f"over-{path}-{field}").calls == 0


def test_sampling_settings_reach_the_engine_as_asked(endpoint):
    asked = requests.parsed(requests.ChatRequest, {"messages": USER, "top_p": 0.25, "temperature": 0, "n": 3,
                                                   "max_tokens": 7, "stop": "zz"})
    sampling = endpoint._sampling(asked)
    assert (sampling.top_p, sampling.temperature, sampling.n, sampling.max_new_tokens, sampling.stop) == \
        (0.25, 0, 3, 7, ("zz",))
    default = endpoint._sampling(requests.parsed(requests.ChatRequest, {"messages": USER}))
    assert (default.top_p, default.temperature, default.max_new_tokens) == (1.0, endpoint.sampling.temperature, 90)


def test_a_refused_unrecorded_request_leaves_no_trace(endpoint):
    answer = _posted(endpoint, "chat/completions", {"messages": [{"role": "user", "content": "x" * 500}]})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context", answer.text
    assert not [name for name in endpoint.traces._episodes if name.startswith("unrecorded-")]


@pytest.mark.parametrize("prompt", ["", []])
def test_an_empty_prompt_is_a_400_not_an_engine_error(endpoint, prompt):
    calls = endpoint.batcher.calls
    answer = _posted(endpoint, "completions", {"prompt": prompt, "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt", answer.text
    assert endpoint.batcher.calls == calls


def test_the_model_is_retrieved_by_name_and_unknown_paths_are_openai_errors(endpoint):
    import openai

    with openai.OpenAI(base_url=endpoint.url, api_key=endpoint.token, max_retries=0) as client:
        assert client.models.retrieve("policy").id == "policy"
        with pytest.raises(openai.NotFoundError) as raised:
            client.models.retrieve("gpt-4o")
    assert raised.value.body["param"] == "model" and "'policy'" in raised.value.body["message"]
    auth = {"Authorization": f"Bearer {endpoint.token}"}
    unknown = _posted(endpoint, "embeddings", {"input": "hi"})
    for answer in (unknown, httpx.get(f"{endpoint.url}/completions", headers=auth)):
        error = answer.json()["error"]
        assert answer.status_code in (404, 405) and error["type"] == "invalid_request_error", answer.text
        assert error["message"].split(":")[0] in ("POST /v1/embeddings", "GET /v1/completions")
