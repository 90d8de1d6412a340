"""Multi-turn episodes: token-in/token-out ids, masks, tools under deadlines, determinism, and the
one-step case; a scripted engine plays the model where the test needs a given turn."""

import time
from collections.abc import Callable

import attrs
import pytest
import torch

from purerl.batch import left_pad, rollout_of
from purerl.data.records import PromptRecord
from purerl.episodes import ChatCodec, SingleTurn, TemplateError, Tool, ToolEnv, calculate
from purerl.episodes.calculator import calculator_env, demonstration
from purerl.episodes.env import EnvError
from purerl.episodes.rollout import (
    EpisodeLimits,
    episode_metrics,
    episode_of_transcript,
    episode_scores,
    episodes_rollout,
    run_episodes,
)
from purerl.episodes.tools import parse_call
from purerl.rewards import lenient_math_reward, math_reward, score_responses
from purerl.rollout.engines import EngineKind
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tiny import char_tokenizer, tiny_llama_config
from tests import episode_envs


class ScriptedEngine:
    """A rollout engine whose "model" is ``script(prompt text, call) -> response ids``; every
    sampled token gets log-prob -0.5."""

    kind = EngineKind("scripted", lambda model, **options: None)
    pad_token_id, device = 0, torch.device("cpu")

    def __init__(self, tokenizer, script: Callable[[str, int], list[int]]) -> None:
        self.tokenizer, self.script, self.version, self.calls = tokenizer, script, 0, 0
        self.prompts: list[list[int]] = []

    def sync(self, params, version):
        self.version = version

    def close(self):
        pass

    def generate(self, prompts, sampling, rng, *, version=None, streams=None):
        self.calls += 1
        self.prompts += [list(p) for p in prompts]
        rows = [self.script(self.tokenizer.decode(p), self.calls)[: sampling.max_new_tokens]
                for p in prompts for _ in range(sampling.n)]
        width = max(len(r) for r in rows)
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        alive = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            tokens[i, : len(r)], alive[i, : len(r)] = torch.tensor(r, dtype=torch.long), True
        ids, mask = left_pad(prompts, 0)
        return rollout_of(ids, mask, tokens, torch.where(alive, -0.5, 0.0), alive, torch.zeros(len(rows)).long(),
                          sampling.n, self.version, sampling.logprob_temperature)


def _text(tokenizer, text: str, end: bool = False) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if end else [])


def _record(question: str = "What is 3*4?", answer: str = "12") -> PromptRecord:
    return PromptRecord(({"role": "user", "content": question},), answer)


def _calculator_script(tokenizer, answer: str = "12") -> Callable[[str, int], list[int]]:
    """Call ``<calc>3*4</calc>`` first, then answer (ending the turn with EOS)."""
    return lambda prompt, call: (_text(tokenizer, "<calc>3*4</calc>") if "<result>12<" not in prompt
                                 else _text(tokenizer, f"#### {answer}", end=True))


def _play(tokenizer, env, script, records, *, n=1, limits=EpisodeLimits(), **kwargs):
    engine = ScriptedEngine(tokenizer, script)
    episodes = run_episodes(engine, env, ChatCodec(tokenizer), records, SamplingParams(max_new_tokens=80, n=n),
                            RngState(0), 0, limits, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                            **kwargs)
    return episodes, engine


def test_ids_are_the_prompt_then_each_turns_sampled_and_delta_ids_and_chatml_renders_the_same():
    tokenizer = char_tokenizer(chatml=True)
    env = calculator_env()
    codec = ChatCodec(tokenizer)
    (episode,), engine = _play(tokenizer, env, _calculator_script(tokenizer), [_record()])
    first, _ = env.reset(_record(), 0)[1], None
    call, answer = _text(tokenizer, "<calc>3*4</calc>"), _text(tokenizer, "#### 12", end=True)
    tool = [{"role": "tool", "content": "<result>12</result>"}]
    delta = codec.delta_ids(tool, last_sampled=call[-1])
    prompt = codec.initial_ids(first)
    assert episode.ids == prompt + call + delta + answer
    assert engine.prompts[1] == prompt + call + delta  # turn 2 continued the ids, not a re-render
    assert sum(episode.sampled) == len(call) + len(answer)  # the end-of-turn token is sampled, in the loss
    assert episode.sampled == [True] * len(call) + [False] * len(delta) + [True] * len(answer)
    assert [lp for lp, s in zip(episode.logprobs, episode.sampled) if not s] == [0.0] * len(delta)
    assert [v for v, s in zip(episode.versions, episode.sampled) if not s] == [-1] * len(delta)
    assert episode.turn_ends == [len(prompt) + len(call) - 1, len(episode.ids) - 1]
    assert (episode.reward, episode.finish, episode.counts) == (1.0, "answer", {"tool_calls": 1.0, "tool_errors": 0.0})
    # the stop string ended turn 1, so the delta closes it: <|im_end|> is an observation token there
    assert tokenizer.decode(delta).startswith("<|im_end|>\n<|im_start|>tool\n<result>12</result>")
    whole = [*first, {"role": "assistant", "content": "<calc>3*4</calc>"}, *tool,
             {"role": "assistant", "content": "#### 12"}]
    rendered = tokenizer.apply_chat_template(whole, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert episode.ids == rendered[:-1]  # all but the template's "\n" after the last <|im_end|>


def test_the_rollout_masks_observation_tokens_and_holds_the_ids():
    tokenizer = char_tokenizer(chatml=True)
    episodes, _ = _play(tokenizer, calculator_env(), _calculator_script(tokenizer), [_record(), _record()], n=2)
    rollout = episodes_rollout(episodes, [0, 0, 1, 1], pad_token_id=0, version=3, temperature=1.0)
    seqs = rollout.sequences
    for row, e in enumerate(episodes):
        length = len(e.ids) - e.prompt_length
        assert seqs.responses()[row, :length].tolist() == e.ids[e.prompt_length:]
        assert seqs.response_mask[row, :length].tolist() == e.sampled
        assert not seqs.response_mask[row, length:].any() and not seqs.attention_mask[row, -seqs.response_length:][length:].any()
        assert seqs.attention_mask[row, -seqs.response_length:][:length].all()  # observations attend
        assert rollout.behaviour_logprobs[row][~seqs.response_mask[row]].eq(0).all()
    assert int(seqs.response_mask.sum()) == sum(sum(e.sampled) for e in episodes)
    assert rollout.version == 3 and rollout.group.tolist() == [0, 0, 1, 1]
    metrics = episode_metrics(episodes)
    assert metrics["episode/turns_mean"] == 2 and metrics["episode/tool_calls_mean"] == 1
    assert 0 < metrics["episode/observation_token_frac"] < 1 and metrics["episode/finish/answer"] == 1
    assert episode_scores(episodes, tool_bonus=0.1) == pytest.approx([1.1] * 4)


def test_a_template_without_an_end_of_turn_token_closes_each_turn_in_the_delta():
    tokenizer = char_tokenizer()  # "role: content" lines; the model's EOS is not in the template
    codec = ChatCodec(tokenizer)
    assert codec.end_of_turn is None and tokenizer.decode(codec.closing) == "\n"
    (episode,), _ = _play(tokenizer, calculator_env(), _calculator_script(tokenizer), [_record()])
    text = tokenizer.decode(episode.ids[episode.prompt_length:])
    assert text == "<calc>3*4</calc>\ntool: <result>12</result>\nassistant: #### 12<eos>"


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name():
    tokenizer = char_tokenizer(chatml=True)
    # drops every assistant message but the last: not append-only (like templates stripping <think>)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>"
                               "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="not append-only"):
        ChatCodec(tokenizer)


@pytest.mark.slow
def test_bpe_ids_that_re_tokenise_differently_are_kept_as_sampled():
    from transformers import AutoTokenizer

    from purerl.models import smollm2_gguf

    path = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # " the" sampled as two tokens (" " then "the"): one token when the text is tokenised again
    sampled = [tokenizer.convert_tokens_to_ids("Ġ"), tokenizer.convert_tokens_to_ids("the")]
    sampled += _text(tokenizer, "<calc>3*4</calc>")
    assert tokenizer.encode(tokenizer.decode(sampled), add_special_tokens=False) != sampled
    script = lambda prompt, call: sampled if call == 1 else _text(tokenizer, "#### 12", end=True)  # noqa: E731
    (episode,), _ = _play(tokenizer, calculator_env(), script, [_record()])
    assert episode.ids[episode.prompt_length: episode.prompt_length + len(sampled)] == sampled
    assert episode.counts["tool_calls"] == 1 and episode.reward == 1.0
    codec = ChatCodec(tokenizer)
    assert codec.end_of_turn == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
def test_hung_crashing_dying_and_slow_tools_each_cost_one_turn_within_the_deadline():
    tokenizer = char_tokenizer(chatml=True)
    tools = tuple(Tool(f.__name__, f, {"name": f.__name__, "parameters": {"properties": {"x": {"type": "string"}}}})
                  for f in (episode_envs.hang, episode_envs.crash, episode_envs.die, episode_envs.slow))
    env = ToolEnv(tools, lenient_math_reward)
    names = ["hang", "crash", "die", "slow"]
    records = [_record(f"use {name}", "7") for name in names]

    def script(prompt: str, call: int) -> list[int]:
        name = next(n for n in names if f"use {n}" in prompt)
        return _text(tokenizer, f"<{name}>1</{name}>") if call == 1 else _text(tokenizer, "#### 7", end=True)

    start = time.monotonic()
    episodes, _ = _play(tokenizer, env, script, records, limits=EpisodeLimits(step_timeout=2.0))
    elapsed = time.monotonic() - start
    assert elapsed < 10, elapsed  # the hung call was stopped at its 2 s deadline, not after its 60 s
    observations = {name: tokenizer.decode([t for t, s in zip(e.ids[e.prompt_length:], e.sampled) if not s])
                    for name, e in zip(names, episodes)}
    assert "error: the step timed out after 2 s" in observations["hang"]
    assert "error: RuntimeError: the tool broke" in observations["crash"]
    assert "error: the reward process died" in observations["die"]
    assert "<result>slow 1</result>" in observations["slow"]
    for e in episodes:  # every episode went on to answer in its second turn
        assert (len(e.turn_ends), e.reward, e.finish) == (2, 1.0, "answer")
    counts = [e.counts for e in episodes]
    assert counts[0] == {"tool_timeouts": 1.0} and counts[1] == {"tool_calls": 1.0, "tool_errors": 1.0}
    assert counts[2] == {"tool_errors": 1.0} and counts[3] == {"tool_calls": 1.0, "tool_errors": 0.0}


def test_an_environment_replays_per_seed_and_a_group_shares_its_initial_state():
    tokenizer = char_tokenizer(chatml=True)
    env = episode_envs.GuessEnv()
    records = [_record("a", "a"), _record("b", "b")]
    guesses = lambda prompt, call: _text(tokenizer, str(10 * call), end=True)  # noqa: E731
    played = [_play(tokenizer, env, guesses, records, n=3, seeds=[5, 6], limits=EpisodeLimits(max_turns=3))[0]
              for _ in range(2)]
    assert [e.ids for e in played[0]] == [e.ids for e in played[1]]  # the same seed, the same episodes
    targets = [e.state for e in played[0]]
    assert targets[:3] == [targets[0]] * 3 and targets[3:] == [targets[3]] * 3  # one start per group
    assert targets[0] != targets[3] and env.reset(records[0], 5)[0] == targets[0]
    assert all(e.finish == "max_turns" and len(e.turn_ends) == 3 for e in played[0])
    higher = [tokenizer.decode(e.ids).count("higher") for e in played[0]]
    assert higher == [sum(10 * k < t for k in (1, 2)) for t in targets]


def test_the_context_budget_ends_an_episode():
    tokenizer = char_tokenizer(chatml=True)
    prompt = len(ChatCodec(tokenizer).initial_ids([{"role": "user", "content": "Guess my number (a)."}]))
    limits = EpisodeLimits(max_turns=4, max_tokens=prompt + 30)
    guesses = lambda prompt, call: _text(tokenizer, "1", end=True)  # noqa: E731
    (episode,), _ = _play(tokenizer, episode_envs.GuessEnv(), guesses, [_record("a", "a")], limits=limits, seeds=[5])
    assert episode.finish == "context" and len(episode.ids) <= limits.max_tokens
    assert len(episode.turn_ends) == 2  # a third turn's observation would not fit
    with pytest.raises(ValueError, match="take .* tokens, no fewer than the episode's budget of 20"):
        _play(tokenizer, episode_envs.GuessEnv(), guesses, [_record("a", "a")], limits=EpisodeLimits(max_tokens=20))


def test_a_single_turn_task_is_the_one_step_episode_of_the_same_engine_call(tiny_lm):
    from purerl.rollout.engine import make_engine

    tokenizer = char_tokenizer()
    model, params = tiny_lm(vocab_size=len(tokenizer), hidden_size=64, seed=0)
    engine = make_engine("torch", model, eos_token_ids=[1], pad_token_id=0,
                         decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    engine.sync(params, 0)
    records = [_record("What is 1+1?", "2"), _record("What is 2+5?", "7")]
    codec, sampling, rng = ChatCodec(tokenizer), SamplingParams(max_new_tokens=12, n=3, temperature=1.0), RngState(4)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    episodes = run_episodes(engine, SingleTurn(math_reward), codec, records, sampling, rng, 0, EpisodeLimits(),
                            decode=decode)
    direct = engine.generate([codec.initial_ids(r.messages) for r in records], sampling, rng, version=0)
    rollout = episodes_rollout(episodes, direct.group.tolist(), pad_token_id=0, version=0, temperature=1.0)
    width = direct.sequences.response_length
    assert torch.equal(rollout.sequences.input_ids[:, : rollout.sequences.input_ids.shape[1]],
                       direct.sequences.input_ids[:, : rollout.sequences.input_ids.shape[1]])
    assert torch.equal(rollout.sequences.response_mask, direct.sequences.response_mask[:, : rollout.sequences.response_length])
    assert not direct.sequences.response_mask[:, rollout.sequences.response_length: width].any()
    assert torch.equal(rollout.behaviour_logprobs, direct.behaviour_logprobs[:, : rollout.sequences.response_length])
    texts = [decode([t for t, m in zip(row, mask) if m]) for row, mask in
             zip(direct.sequences.responses().tolist(), direct.sequences.response_mask.tolist())]
    expected = score_responses(math_reward, texts, [r.ground_truth for r in records for _ in range(3)]).values
    assert episode_scores(episodes) == expected and all(len(e.turn_ends) == 1 for e in episodes)


def test_tool_calls_parse_in_both_formats_and_the_calculator_is_exact():
    assert parse_call("so <calc>347*829</calc>", ["calc"], "tags") == ("calc", "347*829")
    assert parse_call("<calc>1+1</calc> and more", ["calc"], "tags") is None  # only a call ending the turn
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
    assert parse_call(call, ["calc"], "json") == ("calc", '{"expression": "2*3"}')
    assert parse_call("<tool_call>not json</tool_call>", ["calc"], "json") == ("?", "not json")
    assert calculate("347*829") == "287663" and calculate("(1+2)*3 - 4/2") == "7" and calculate("7/2") == "3.5"
    for bad in ("__import__('os')", "2**100000", "9" * 300):
        with pytest.raises(Exception):
            calculate(bad)
    env = calculator_env(format="json")
    state, _ = env.reset(_record(), 0)
    result = env.step(state, call)
    assert result.messages[0]["content"] == "6" and not result.done
    result = env.step(state, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    assert result.messages[0]["content"].startswith("error: ValueError: no tool named 'nope'")
    assert result.counts["tool_errors"] == 1
    assert env.step(state, "#### 12").reward == 1.0 and env.stop == ("</tool_call>",)


def test_a_demonstration_is_the_episode_sampling_would_have_built():
    from purerl.data.math_problems import math_problems

    tokenizer = char_tokenizer(chatml=True)
    codec, env = ChatCodec(tokenizer), calculator_env()
    record = math_problems(1, seed=0, difficulties=(5,))[0]
    messages = demonstration(record, env)
    episode = episode_of_transcript(codec, messages, stop=env.stop)
    assert tokenizer.decode([t for t, s in zip(episode.ids[episode.prompt_length:], episode.sampled) if s]) == (
        f"<calc>{record.extra['expression']}</calc>#### {record.ground_truth}<|im_end|>")
    rendered = tokenizer.apply_chat_template(messages, tokenize=True)
    assert episode.ids == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)[:-1]
    assert demonstration(record, calculator_env(tools=False))[-1]["content"] == f"#### {record.ground_truth}"
    with pytest.raises(ValueError, match="expression"):
        demonstration(_record(), env)
    assert attrs.evolve(env, tools=()).stop == ()


def test_multi_turn_kv_reuse_gives_the_log_probs_of_a_full_re_prefill(tiny_lm):
    from purerl.rollout.engine import make_engine

    tokenizer = char_tokenizer(chatml=True)
    config = tiny_llama_config(vocab_size=len(tokenizer), hidden_size=64, max_position_embeddings=1024,
                               eos_token_id=tokenizer.eos_token_id)
    model, params = tiny_lm(config, seed=1)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    engine = make_engine("torch", model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0, decode=decode)
    engine.sync(params, 0)
    env = episode_envs.GuessEnv()  # every turn is answered, so episodes run all their turns
    records = [_record("a", "a"), _record("bb", "b"), _record("ccc", "c")]
    sampling = SamplingParams(max_new_tokens=10, n=2, temperature=1.0)
    played = {reuse: run_episodes(engine, env, ChatCodec(tokenizer), records, sampling, RngState(3), 0,
                                  EpisodeLimits(max_turns=3, max_tokens=400), decode=decode, reuse_cache=reuse)
              for reuse in (True, False)}
    assert sum(len(e.turn_ends) for e in played[True]) > len(played[True])  # later turns happened
    for reused, full in zip(played[True], played[False]):
        assert reused.ids == full.ids and reused.sampled == full.sampled
        assert torch.allclose(torch.tensor(reused.logprobs), torch.tensor(full.logprobs), atol=1e-5)
    session = engine.session()
    prompt = ChatCodec(tokenizer).initial_ids([{"role": "user", "content": "hi"}])
    first = session.generate([prompt], SamplingParams(max_new_tokens=6, n=1, temperature=1.0), RngState(0), version=0)
    sampled = first.sequences.responses()[0][first.sequences.response_mask[0]].tolist()
    before = session.prefilled_tokens
    session.generate([prompt + sampled + [5, 6, 7]], SamplingParams(max_new_tokens=4, n=1), RngState(1), version=0,
                     previous=[0])
    assert session.prefilled_tokens - before == 4  # the last sampled token and the three new ids, not the context


def test_a_trl_environment_factory_class_plays_with_its_tools_and_reward_and_a_state_per_episode():
    from purerl.environments import environment_of
    from purerl.episodes.adapters import TrlEnvironment

    tokenizer = char_tokenizer(chatml=True)
    _, env = environment_of("tests.episode_envs:Counter", answer_fn=math_reward, format="json")
    assert isinstance(env, TrlEnvironment) and env.tool_names == ["increment"] and env.stop == ("</tool_call>",)
    assert env.chat_tools[0]["function"]["parameters"]["properties"]["step"]["type"] == "integer"

    def call(step: int) -> list[int]:
        return _text(tokenizer, '<tool_call>{"name": "increment", "arguments": {"step": %d}}</tool_call>' % step)

    def script(prompt: str, turn: int) -> list[int]:  # the first sample adds 2, the second 1; both add 1 more
        if turn == 1:
            script.rows = getattr(script, "rows", 0) + 1
            return call(2 if script.rows == 1 else 1)
        return call(1) if turn == 2 else _text(tokenizer, "done", end=True)

    # a generous step deadline: the steps run in reward processes, which a loaded machine may start slowly
    (first, second), _ = _play(tokenizer, env, script, [_record("Count.", "3")], n=2,
                               limits=EpisodeLimits(step_timeout=120.0))
    assert "Count. Reach 3." in tokenizer.decode(first.ids[: first.prompt_length])
    assert first.counts == {"tool_calls": 2.0, "tool_errors": 0.0} and len(first.turn_ends) == 3, \
        (first.counts, tokenizer.decode(first.ids[first.prompt_length:]))  # a failed step's message is in its observation
    assert first.state[0].count == 3 and second.state[0].count == 2
    assert (first.reward, second.reward) == (1.0, 0.0)  # 2+1 = 3 and 1+1 = 2: each episode its own counter
    with pytest.raises(ValueError, match="environment 'tests.episode_envs:hang'"):
        environment_of("tests.episode_envs:hang", answer_fn=math_reward)
    with pytest.raises(ValueError, match="no attribute 'Nope'"):
        environment_of("tests.episode_envs:Nope", answer_fn=math_reward)


def test_a_broken_environment_stops_naming_itself_the_task_and_what_went_wrong():
    tokenizer = char_tokenizer(chatml=True)
    answer = lambda prompt, call: _text(tokenizer, "1", end=True)  # noqa: E731
    with pytest.raises(ValueError, match=r"environment Broken: reset failed on task 0 \(unknown, seed 0\): KeyError"):
        _play(tokenizer, episode_envs.Broken(), answer, [_record()])
    sized = PromptRecord(({"role": "user", "content": "hi"},), "1", extra={"size": 3})
    with pytest.raises(EnvError, match="environment Broken: Env.step returned float, not"):
        _play(tokenizer, episode_envs.Broken(), answer, [sized])


@pytest.mark.parametrize("name, why", [
    ("NoneReward", "bad reward: the reward is a NoneType"), ("StringReward", "bad reward: the reward is a str ('good')"),
    ("NaNReward", "bad reward: the reward is nan"), ("StringMessages", "messages as a str ('just a string')"),
    ("RoleLessMessage", "message 0 as {'content': 'no role'}")])
def test_an_environment_returning_a_bad_reward_or_messages_ends_its_episode_naming_task_seed_and_turn(name, why):
    tokenizer = char_tokenizer(chatml=True)
    answer = lambda prompt, call: _text(tokenizer, "1", end=True)  # noqa: E731
    episodes, _ = _play(tokenizer, getattr(episode_envs, name)(), answer, [_record(), _record()], n=2, seeds=[4, 9])
    assert [e.finish for e in episodes] == ["env_error"] * 4 and all(e.reward == 0.0 for e in episodes)
    assert episodes[3].counts == {"env_errors": 1.0}
    assert episodes[3].error.startswith(f"environment {name}, task 1 (unknown), seed 9, turn 0: Env.step returned")
    assert why in episodes[3].error
    assert episode_metrics(episodes)["episode/env_errors"] == 4


def test_a_trl_environment_whose_reward_is_none_ends_its_episode():
    from purerl.environments import environment_of

    tokenizer = char_tokenizer(chatml=True)
    _, env = environment_of("tests.episode_envs:NoReward", answer_fn=math_reward)
    answer = lambda prompt, call: _text(tokenizer, "done", end=True)  # noqa: E731
    (episode,), _ = _play(tokenizer, env, answer, [_record()])
    assert episode.finish == "env_error" and "the reward is a NoneType" in episode.error


def test_a_10_mb_observation_is_cut_to_what_the_budget_could_hold_before_it_is_tokenised(monkeypatch):
    from purerl.episodes import rollout

    tokenizer = char_tokenizer(chatml=True)
    answer = lambda prompt, call: _text(tokenizer, "1", end=True)  # noqa: E731
    read = []
    delta_ids = ChatCodec.delta_ids
    monkeypatch.setattr(ChatCodec, "delta_ids", lambda self, messages, **kw: read.append(
        sum(len(m["content"]) for m in messages)) or delta_ids(self, messages, **kw))
    (episode,), _ = _play(tokenizer, episode_envs.HugeObservation(), answer, [_record()],
                          limits=EpisodeLimits(max_tokens=256))
    assert episode.finish == "context" and max(read) == 256 * rollout.CHARS_PER_TOKEN


def test_a_state_that_does_not_pickle_stops_the_run_in_one_line_naming_the_environment():
    tokenizer = char_tokenizer(chatml=True)
    answer = lambda prompt, call: _text(tokenizer, "1", end=True)  # noqa: E731
    with pytest.raises(EnvError, match=r"^environment LockedState: a state does not pickle \(TypeError: cannot "
                                       r"pickle '_thread.lock' object\); states travel"):
        _play(tokenizer, episode_envs.LockedState(), answer, [_record()])
