"""Agents behind an OpenAI-compatible endpoint: the official ``openai`` client talks to it (chat,
tools, log-probs), its episodes are the Env path's token for token, concurrent agents share
engine calls, strangers are refused, edited histories become counted segments, and agent
functions train in the job."""

import json
import sys
import threading
import time

import pytest
import torch

from purerl.agents import AgentEnv, Endpoint, EngineBatcher, EpisodeTraces, run_agents, tool_calls_of
from purerl.agents.traces import EPISODE_HEADER
from purerl.data.records import PromptRecord
from purerl.episodes import ChatCodec, Tool, ToolEnv
from purerl.episodes.rollout import EpisodeLimits, episode_metrics, episodes_rollout, run_episodes
from purerl.models import response_logprobs
from purerl.rewards import lenient_math_reward
from purerl.rollout.engine import make_engine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tiny import char_tokenizer, tiny_llama_config
from tests import agent_fns, episode_envs, processes
from tests.jobs import ENV, SCRIPT, run_job
from tests.test_episodes import ScriptedEngine, _text

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny(tiny_lm):
    tokenizer = char_tokenizer(chatml=True)
    config = tiny_llama_config(vocab_size=len(tokenizer), hidden_size=64, max_position_embeddings=1024,
                               eos_token_id=tokenizer.eos_token_id)
    model, params = tiny_lm(config, seed=1)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    engine = make_engine("torch", model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0, decode=decode)
    engine.sync(params, 0)
    return tokenizer, model, params, engine, decode


def _endpoint(tokenizer, engine, decode, *, sampling=SamplingParams(max_new_tokens=12, n=1, temperature=1.0),
              limits=EpisodeLimits(max_turns=4, max_tokens=400), rng=RngState(5)):
    batcher = EngineBatcher(engine, rng, 0, thread=True)
    traces = EpisodeTraces(ChatCodec(tokenizer), max_turns=limits.max_turns, max_tokens=limits.max_tokens)
    return Endpoint(batcher, traces, decode=decode, token_text=lambda t: tokenizer.decode([t]), sampling=sampling)


def _records(*questions):
    return [PromptRecord(({"role": "user", "content": q},), "12") for q in questions]


def test_the_openai_client_samples_the_engines_ids_with_the_trainers_log_probs(tiny):
    tokenizer, model, params, engine, decode = tiny
    with _endpoint(tokenizer, engine, decode) as endpoint:
        with openai.OpenAI(base_url=endpoint.url, api_key=endpoint.token, max_retries=0,
                           default_headers={EPISODE_HEADER: "e"}) as client:
            messages = [{"role": "user", "content": "What is 3*4?"}]
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=9, n=3, logprobs=True)
            assert [m.id for m in client.models.list().data] == ["policy"]
    assert len(reply.choices) == 3 and reply.usage.completion_tokens == sum(len(c.model_extra["token_ids"])
                                                                            for c in reply.choices)
    prompt = ChatCodec(tokenizer).initial_ids(messages)
    assert reply.model_extra["prompt_token_ids"] == prompt
    stream = endpoint.stream_of("e", 0, 3)
    direct = engine.generate([prompt], SamplingParams(max_new_tokens=9, n=3, temperature=1.0), RngState(5),
                             streams=[stream[0]])  # a request of n draws samples 0 … n-1 of its stream
    trainer = response_logprobs(model, params, direct.sequences, temperature=1.0)
    for row, choice in enumerate(reply.choices):
        mask = direct.sequences.response_mask[row]
        ids = direct.sequences.responses()[row][mask].tolist()
        assert choice.model_extra["token_ids"] == ids
        assert choice.message.content == decode(ids) and choice.message.role == "assistant"
        served = torch.tensor([t.logprob for t in choice.logprobs.content])
        torch.testing.assert_close(served, trainer[row][mask], rtol=0, atol=1e-5)
        assert "".join(t.token for t in choice.logprobs.content) == tokenizer.decode(ids)


def test_tool_calls_are_parsed_from_hermes_json_and_bad_json_stays_text():
    content, calls = tool_calls_of('Let me compute. <tool_call>{"name": "calculate", "arguments": {"expression": '
                                   '"3*4"}}</tool_call>')
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["function"] == {"name": "calculate", "arguments": '{"expression": "3*4"}'}
    assert tool_calls_of("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])


CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "3*4"}}</tool_call>'


def _tool_script(tokenizer):
    """Call the calculator twice, then answer: a 3-turn tool episode."""
    def script(prompt: str, call: int) -> list[int]:
        results = prompt.count("tool\n12")
        return _text(tokenizer, CALL) if results < 2 else _text(tokenizer, "#### 12", end=True)
    return script


def test_a_three_turn_tool_episode_through_the_endpoint_is_the_env_paths_token_for_token():
    tokenizer = char_tokenizer(chatml=True)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    codec, limits = ChatCodec(tokenizer), EpisodeLimits(max_turns=4, max_tokens=600)
    sampling = SamplingParams(max_new_tokens=90, n=2, temperature=1.0)
    env = ToolEnv((Tool.of(agent_fns.calculate),), lenient_math_reward, format="json")
    tools = {"tools": env.chat_tools}
    records = _records("What is 3*4?", "And 4*3?")
    by_env = run_episodes(ScriptedEngine(tokenizer, _tool_script(tokenizer)), env, codec, records, sampling,
                          RngState(0), 0, limits, decode=decode, template_kwargs=tools)
    engine = ScriptedEngine(tokenizer, _tool_script(tokenizer))
    by_agent = run_agents(engine, AgentEnv(agent_fns.calculator, lenient_math_reward), codec, records, sampling,
                          RngState(0), 0, limits, decode=decode, template_kwargs=tools)
    for e, a in zip(by_env, by_agent, strict=True):
        assert len(e.turn_ends) == 3 and e.finish == a.finish == "answer"
        assert a.ids == e.ids and a.sampled == e.sampled and a.logprobs == e.logprobs and a.turn_ends == e.turn_ends
        assert a.reward == e.reward == 1.0 and a.actions[-1] == e.actions[-1] == "#### 12"
    group = [0, 0, 1, 1]
    rollouts = [episodes_rollout(p, group, pad_token_id=0, version=0, temperature=1.0)
                for p in (by_env, by_agent)]
    for field in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(rollouts[0].sequences, field), getattr(rollouts[1].sequences, field))
    assert engine.calls <= 6  # four agents' 12 calls: batched (one engine call per turn when they arrive together)


def test_sampled_multi_turn_episodes_draw_as_the_env_path_does(tiny):
    tokenizer, _, _, engine, decode = tiny
    records = _records("a", "bb")
    sampling, limits = SamplingParams(max_new_tokens=8, n=2, temperature=1.0), EpisodeLimits(max_turns=3, max_tokens=400)
    env = episode_envs.GuessEnv()
    task_records = [PromptRecord(({"role": "user", "content": f"Guess my number ({r.ground_truth})."},),
                                 r.ground_truth) for r in records]
    by_env = run_episodes(engine, env, ChatCodec(tokenizer), task_records, sampling, RngState(7), 0, limits,
                          decode=decode, reuse_cache=False)
    by_agent = run_agents(engine, AgentEnv(agent_fns.guess, lenient_math_reward), ChatCodec(tokenizer), records,
                          sampling, RngState(7), 0, limits, decode=decode)
    for e, a in zip(by_env, by_agent, strict=True):
        assert a.ids == e.ids and a.sampled == e.sampled
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(e.logprobs), rtol=0, atol=1e-5)
    assert len({tuple(a.ids) for a in by_agent}) == 4  # different draws per episode


def test_thirty_two_concurrent_agents_share_engine_calls():
    tokenizer = char_tokenizer(chatml=True)
    engine = ScriptedEngine(tokenizer, _tool_script(tokenizer))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    played = run_agents(engine, AgentEnv(agent_fns.calculator, lenient_math_reward, window_s=0.05),
                        ChatCodec(tokenizer), _records(*(f"q{i}" for i in range(8))),
                        SamplingParams(max_new_tokens=90, n=4), RngState(0), 0,
                        EpisodeLimits(max_turns=4, max_tokens=600), decode=decode)
    assert len(played) == 32 and all(len(e.turn_ends) == 3 and e.reward == 1.0 for e in played)
    assert len(engine.prompts) == 96  # every call served
    assert engine.calls <= 24  # 96 calls in three rounds: batched (3 engine calls when all arrive together)
    print(f"32 agents, 96 calls: {engine.calls} engine calls")


def test_strangers_are_refused(tiny):
    from fastapi.testclient import TestClient

    tokenizer, _, _, engine, decode = tiny
    with _endpoint(tokenizer, engine, decode) as endpoint:
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for key in (None, "wrong"):
            with openai.OpenAI(base_url=endpoint.url, api_key=key or "none", max_retries=0) as client, \
                    pytest.raises(openai.AuthenticationError):
                client.chat.completions.create(**body)
        remote = TestClient(endpoint._server.config.app)  # its requests come from a non-loopback client
        refused = remote.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {endpoint.token}"})
        assert refused.status_code == 403 and "loopback" in refused.json()["error"]["message"]
        assert endpoint.refused == 3 and endpoint.batcher.calls == 0


def test_an_edited_history_starts_a_counted_segment_and_agent_failures_are_episode_errors(tiny):
    tokenizer, _, _, engine, decode = tiny
    codec, sampling = ChatCodec(tokenizer), SamplingParams(max_new_tokens=4, n=1, temperature=1.0)
    limits = EpisodeLimits(max_turns=3, max_tokens=400, step_timeout=2.0)
    played = {name: run_agents(engine, AgentEnv(getattr(agent_fns, name), lenient_math_reward), codec, _records("q"),
                               sampling, RngState(0), 0, limits, decode=decode)[0]
              for name in ("forgetful", "broken", "silent")}
    forgetful = played["forgetful"]
    assert forgetful.counts["new_segments"] == 1 and forgetful.reward == 0.5 and forgetful.finish == "answer"
    assert codec.initial_ids([{"role": "user", "content": "start over"}]) == forgetful.ids[: forgetful.prompt_length]
    assert episode_metrics([forgetful])["episode/new_segments"] == 1
    assert played["broken"].finish == "env_error" and "RuntimeError: the agent's own bug" in played["broken"].error
    assert "agent_fns.py" in played["broken"].error and "task 0" in played["broken"].error
    assert played["silent"].finish == "env_error" and "made no call" in played["silent"].error


def test_calls_past_the_episodes_turns_are_refused_in_one_line(tiny):
    tokenizer, _, _, engine, decode = tiny
    with _endpoint(tokenizer, engine, decode, limits=EpisodeLimits(max_turns=1, max_tokens=400)) as endpoint:
        with openai.OpenAI(base_url=endpoint.url, api_key=endpoint.token, max_retries=0,
                           default_headers={EPISODE_HEADER: "e"}) as client:
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            with pytest.raises(openai.BadRequestError, match="has made its 1 calls"):
                client.chat.completions.create(model="policy", messages=messages, max_tokens=2)


def test_an_episodes_next_call_prefills_only_its_new_ids(tiny):
    tokenizer, _, _, engine, decode = tiny
    with _endpoint(tokenizer, engine, decode) as endpoint, \
            openai.OpenAI(base_url=endpoint.url, api_key=endpoint.token, max_retries=0,
                          default_headers={EPISODE_HEADER: "e"}) as client:
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        session = endpoint.batcher._session
        assert session.prefilled_tokens == len(first.model_extra["prompt_token_ids"])
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        second = client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    sampled = first.choices[0].model_extra["token_ids"]
    new = len(second.model_extra["prompt_token_ids"]) - len(first.model_extra["prompt_token_ids"]) - len(sampled)
    assert new > 0 and session.prefilled_tokens == len(first.model_extra["prompt_token_ids"]) + 1 + new
    # the last sampled id was never fed through the model: it is prefilled with the new ones


def test_concurrent_clients_on_threads_each_get_their_own_episode(tiny):
    tokenizer, _, _, engine, decode = tiny
    with _endpoint(tokenizer, engine, decode) as endpoint:
        def one(k: int, out: dict) -> None:
            with openai.OpenAI(base_url=endpoint.url, api_key=endpoint.token, max_retries=0,
                               default_headers={EPISODE_HEADER: f"e{k}"}) as client:
                out[k] = client.chat.completions.create(model="policy", max_tokens=3,
                                                        messages=[{"role": "user", "content": str(k)}],
                                                        ).choices[0].message.content
        out: dict = {}
        threads = [threading.Thread(target=one, args=(k, out)) for k in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(out) == 8
        assert all(len(endpoint.traces.pop(f"e{k}").segments) == 1 for k in range(8))


@pytest.mark.parametrize("mode", [[], ["--async", "--max-staleness", "1"]], ids=["sync", "async"])
def test_an_agent_function_trains_in_the_job(tmp_path, mode):
    summary = run_job(["--tiny", "--env", "tests.agent_fns:guess", "--max-turns", "3", "--steps", "2",
                       "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size",
                       "2", "--train-size", "20", "--eval-every", "0", "--no-progress", "--threads", "1",
                       "env.max_tokens=256", *mode, "--out-dir", str(tmp_path / "run")])
    assert summary["steps"] == 2
    for row in summary["records"]:
        assert row["episode/turns_mean"] == 3 and row["episode/env_errors"] == 0
        assert 0 < row["episode/observation_token_frac"] < 1 and row["episode/new_segments"] == 0
    assert summary["final_evaluation"]["val/episode/turns_mean"] == 3
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s.get("turns") == 3 for s in samples if "turns" in s)


def test_an_async_agent_function_plays_on_an_async_client(tiny):
    tokenizer, _, _, engine, decode = tiny
    sampling, limits = SamplingParams(max_new_tokens=8, n=2, temperature=1.0), EpisodeLimits(max_turns=3, max_tokens=400)
    played = {fn: run_agents(engine, AgentEnv(getattr(agent_fns, fn), lenient_math_reward), ChatCodec(tokenizer),
                             _records("a", "bb"), sampling, RngState(7), 0, limits, decode=decode)
              for fn in ("guess", "guess_async")}
    for s, a in zip(played["guess"], played["guess_async"], strict=True):
        assert s.ids == a.ids and s.reward == a.reward


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["tests.verifiers_envs:load_environment", "tests.verifiers_envs:multi_turn"],
                         ids=["single_turn", "multi_turn"])
@pytest.mark.parametrize("mode", [[], ["--async", "--max-staleness", "1"]], ids=["sync", "async"])
def test_verifiers_environments_train_as_they_are(tmp_path, spec, mode):
    pytest.importorskip("verifiers")
    summary = run_job(["--tiny", "--env", spec, "--max-turns", "3", "--steps", "2", "--prompts-per-step", "2",
                       "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size", "2", "--train-size", "20",
                       "--eval-every", "0", "--no-progress", "--threads", "1", "env.max_tokens=256", *mode,
                       "--out-dir", str(tmp_path / "run")])
    turns = 1 if spec.endswith("load_environment") else 3
    assert summary["steps"] == 2
    for row in summary["records"]:
        assert row["episode/turns_mean"] == turns and row["episode/env_errors"] == 0 and row["reward/errors"] == 0
        assert row["episode/finish/answer"] == 1 and row["episode/new_segments"] == 0


def test_a_verifiers_rubric_scores_the_recorded_episode(tiny):
    verifiers_envs = pytest.importorskip("tests.verifiers_envs")
    from purerl.environments import environment_of

    tokenizer, _, _, engine, decode = tiny
    _, env = environment_of("tests.verifiers_envs:load_environment", answer_fn=lenient_math_reward)
    played = run_agents(engine, env, ChatCodec(tokenizer), _records("What is 2+2?"),
                        SamplingParams(max_new_tokens=6, n=4, temperature=1.0), RngState(0), 0,
                        EpisodeLimits(max_turns=1, max_tokens=400), decode=decode)
    for e in played:  # the rubric: 1 for ending with the answer, 0.5 for a digit, on the text the model sampled
        text = e.actions[-1]
        rubric = float(text.strip().endswith("12")) + 0.5 * any(c.isdigit() for c in text)
        assert e.reward == rubric and e.finish == "answer"
        prompt = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]
        assert e.ids[: e.prompt_length] == ChatCodec(tokenizer).initial_ids(prompt)
    assert verifiers_envs is not None


@pytest.mark.slow
def test_an_agent_function_trains_on_ray(tmp_path, ray_cluster):
    summary = run_job(["--tiny", "--env", "tests.agent_fns:guess", "--max-turns", "3", "--steps", "2",
                       "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size",
                       "2", "--train-size", "20", "--eval-every", "0", "--no-progress", "--threads", "1",
                       "env.max_tokens=256", "--executor", "ray", "--train-ranks", "2", "--rollout-workers", "1",
                       "--out-dir", str(tmp_path / "run")])
    assert summary["steps"] == 2
    for row in summary["records"]:
        assert row["episode/turns_mean"] == 3 and row["episode/env_errors"] == 0


def test_the_docs_agent_function_trains_unchanged(tmp_path):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "agents.md").read_text()
    code = page.split("# my_agent.py")[1].split("\n", 1)[1].split("```")[0]
    (tmp_path / "my_agent.py").write_text(code)
    summary = run_job(["--tiny", "--env", f"{tmp_path / 'my_agent.py'}:run", "--max-turns", "2", "--steps", "1",
                       "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size",
                       "2", "--train-size", "20", "--eval-every", "0", "--no-progress", "--threads", "1",
                       "env.max_tokens=256", "--out-dir", str(tmp_path / "run")])
    row = summary["records"][0]
    assert row["episode/turns_mean"] == 2 and row["episode/env_errors"] == 0 and row["episode/new_segments"] == 0


@pytest.mark.parametrize("name", ["second_chance", "load_environment"])
def test_the_example_agents_train(tmp_path, name):
    from pathlib import Path

    if name == "load_environment":
        pytest.importorskip("verifiers")
    example = Path(__file__).resolve().parents[1] / "examples" / "agent_functions.py"
    summary = run_job(["--tiny", "--env", f"{example}:{name}", "--max-turns", "2", "--steps", "1",
                       "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size",
                       "2", "--train-size", "20", "--eval-every", "0", "--no-progress", "--threads", "1",
                       "--out-dir", str(tmp_path / "run")])
    row = summary["records"][0]
    assert row["episode/turns_mean"] == 2 and row["episode/env_errors"] == 0  # a random model is never right


def test_a_verifiers_tool_env_calls_its_tool_through_the_endpoint():
    pytest.importorskip("verifiers")
    from purerl.environments import environment_of

    tokenizer = char_tokenizer(chatml=True)
    call = '<tool_call>{"name": "square", "arguments": {"x": 12}}</tool_call>'
    engine = ScriptedEngine(tokenizer, lambda prompt, k: _text(tokenizer, call) if "tool\n144" not in prompt
                            else _text(tokenizer, "#### 144", end=True))
    _, env = environment_of("tests.verifiers_envs:tool_env", answer_fn=lenient_math_reward)
    played = run_agents(engine, env, ChatCodec(tokenizer), [PromptRecord(({"role": "user", "content": "12²?"},), "144")],
                        SamplingParams(max_new_tokens=80, n=2), RngState(0), 0, EpisodeLimits(max_turns=3, max_tokens=600),
                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    for e in played:  # the tool's result came back as an observation, then the answer; the rubric scored it
        assert len(e.turn_ends) == 2 and e.reward == 1.0 and e.counts["new_segments"] == 0
        observed = [t for t, s in zip(e.ids[e.prompt_length:], e.sampled) if not s]
        assert "tool\n144" in tokenizer.decode(observed)


@pytest.mark.slow
def test_a_hung_agent_is_abandoned_and_the_job_still_exits(tmp_path):
    """An agent that calls once and then sleeps forever becomes an env_error episode after
    env.step_timeout, and the process exits soon after its last step (its thread never holds it)."""
    argv = [sys.executable, str(SCRIPT), "--tiny", "--env", "tests.agent_fns:hangs", "--max-turns", "2", "--steps", "1",
            "--prompts-per-step", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--eval-size", "1",
            "--train-size", "10", "--eval-every", "0", "--no-progress", "--threads", "1", "env.step_timeout=3",
            "env.max_tokens=256", "--out-dir", str(tmp_path / "run")]
    started = time.monotonic()
    done = processes.run(argv, cwd=SCRIPT.parents[1], env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    written = (tmp_path / "run" / "summary.json").stat().st_mtime
    assert time.time() - written < 60  # exited within seconds of writing its summary (before: never)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and time.monotonic() - started < 280


def _fixed_endpoint(tokenizer, engine, decode, **kwargs):
    """An endpoint whose every call draws from one stream: two requests alike sample alike."""
    batcher = EngineBatcher(engine, RngState(5), 0, thread=True)
    traces = EpisodeTraces(ChatCodec(tokenizer), max_turns=4, max_tokens=kwargs.pop("max_tokens", 400))
    return Endpoint(batcher, traces, decode=decode, token_text=lambda t: tokenizer.decode([t]),
                    sampling=SamplingParams(max_new_tokens=12, n=1, temperature=1.0),
                    stream_of=lambda name, turn, n: (7, 0))


def test_streamed_answers_are_the_answers_as_server_sent_events(tiny):
    tokenizer, _, _, engine, decode = tiny
    with _fixed_endpoint(tokenizer, engine, decode) as endpoint, \
            openai.OpenAI(base_url=endpoint.url, api_key=endpoint.token, max_retries=0) as client:
        ask = dict(model="policy", messages=[{"role": "user", "content": "What is 3*4?"}], max_tokens=8, n=2,
                   logprobs=True)
        whole = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        texts, ids, logprobs, finishes = {}, {}, {}, {}
        for chunk in chunks[:-1]:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                ids[choice.index] = ids.get(choice.index, []) + choice.model_extra.get("token_ids", [])
                logprobs[choice.index] = logprobs.get(choice.index, []) + [
                    t.logprob for t in (choice.logprobs.content if choice.logprobs else [])]
                finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
        for choice in whole.choices:
            assert texts[choice.index] == choice.message.content and finishes[choice.index] == choice.finish_reason
            assert ids[choice.index] == choice.model_extra["token_ids"]
            assert logprobs[choice.index] == [t.logprob for t in choice.logprobs.content]
        text = client.completions.create(model="policy", prompt="3*4=", max_tokens=6)
        streamed = list(client.completions.create(model="policy", prompt="3*4=", max_tokens=6, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
        assert streamed[-1].choices[0].finish_reason == text.choices[0].finish_reason


@pytest.mark.parametrize("field, body", [
    ("n", {"n": 0}), ("seed", {"seed": 1}), ("response_format", {"response_format": {"type": "json_object"}}),
    ("tool_choice", {"tool_choice": "required"}), ("presence_penalty", {"presence_penalty": 0.5}),
    ("messages[1].role", {"messages": [{"role": "user", "content": "a"}, {"content": "no role"}]}),
    ("max_tokens", {"max_tokens": 0}),
])
def test_a_request_it_cannot_honour_is_a_400_naming_the_field(tiny, field, body):
    import httpx

    tokenizer, _, _, engine, decode = tiny
    with _fixed_endpoint(tokenizer, engine, decode) as endpoint:
        request = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
        answer = httpx.post(f"{endpoint.url}/chat/completions", json=request,
                            headers={"Authorization": f"Bearer {endpoint.token}"})
        assert answer.status_code == 400 and field in answer.json()["error"]["message"], answer.text
        assert endpoint.batcher.calls == 0


def test_bad_bodies_and_prompts_are_400s_in_one_line(tiny):
    import httpx

    tokenizer, _, _, engine, decode = tiny
    with _fixed_endpoint(tokenizer, engine, decode, max_tokens=40) as endpoint:
        auth = {"Authorization": f"Bearer {endpoint.token}"}
        for path, content in (("chat/completions", b"{not json"), ("completions", b"[1, 2]")):
            answer = httpx.post(f"{endpoint.url}/{path}", content=content, headers=auth)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
        for prompt in ([5, len(tokenizer) + 3], [5, -1]):
            answer = httpx.post(f"{endpoint.url}/completions", json={"prompt": prompt, "max_tokens": 2}, headers=auth)
            assert answer.status_code == 400 and "outside the vocabulary" in answer.json()["error"]["message"]
        answer = httpx.post(f"{endpoint.url}/completions", json={"prompt": [5] * 40, "max_tokens": 2}, headers=auth)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
        assert endpoint.batcher.calls == 0
