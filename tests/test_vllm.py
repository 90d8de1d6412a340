"""The vLLM rollout backend against the trainer, on SmolLM2 (fp32).

Runs where vLLM is installed: CI builds a second environment with vLLM's CPU build for these
tests (``tools/vllm_env.sh``); in the main environment they skip.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from purerl.models import load_causal_lm, response_logits, smollm2_gguf  # noqa: E402
from purerl.rollout.backends.vllm import VllmEngine  # noqa: E402
from purerl.rollout.engine import make_engine  # noqa: E402
from purerl.rollout.sampling import SamplingParams, sampling_logprobs  # noqa: E402
from purerl.state import RngState  # noqa: E402

# vLLM's own imports and start-up raise deprecation warnings of torch and its dependencies
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is 2+3?", "Name a colour.", "Tom has 4 apples and eats one. How many are left?"]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model, params = load_causal_lm(gguf)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False) for q in QUESTIONS]
    return model, params, [list(p) for p in prompts], tokenizer.eos_token_id


@pytest.fixture(scope="module")
def long_prompts(smollm2):
    """The prompts behind a 300-token preamble: vLLM caches only whole blocks of a prefix."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    preamble = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).encode(
        "The quick brown fox jumps over the lazy dog. " * 30, add_special_tokens=False)
    return [preamble + p for p in smollm2[2]]


def _engine(model, eos):
    return make_engine("vllm", model, eos_token_ids=[eos], pad_token_id=eos)


@pytest.fixture(scope="module")
def engine(smollm2):
    model, params, _, eos = smollm2
    engine = _engine(model, eos)
    engine.sync(params, 0)
    yield engine
    engine.close()


def _trainer_logprobs(model, params, rollout, sampling):
    logits = response_logits(model, params, rollout.sequences)
    lp = sampling_logprobs(logits.flatten(0, 1), temperature=sampling.temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p).view(*logits.shape)
    return lp.gather(-1, rollout.sequences.responses()[..., None]).squeeze(-1)


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=24, n=2, temperature=1.0),
                                      SamplingParams(max_new_tokens=24, n=2, temperature=0.7, top_k=40, top_p=0.9)],
                         ids=["plain", "tempered-top-k-top-p"])
def test_engine_logprobs_equal_the_trainers_for_the_same_tokens(smollm2, engine, sampling):
    model, params, prompts, eos = smollm2
    assert isinstance(engine, VllmEngine)
    rollout = engine.generate(prompts, sampling, RngState(0), version=0)
    mask = rollout.sequences.response_mask
    assert rollout.group.tolist() == [0, 0, 1, 1, 2, 2] and rollout.version == 0
    trainer = _trainer_logprobs(model, params, rollout, sampling)
    gap = (trainer - rollout.behaviour_logprobs)[mask].abs().max().item()
    assert gap <= 1e-4, gap
    assert (rollout.behaviour_logprobs[~mask] == 0).all()
    lengths = mask.sum(1)
    last = rollout.sequences.responses().gather(1, (lengths - 1)[:, None]).squeeze(1)
    eos_rows = rollout.finish_reasons == 0
    assert (last[eos_rows] == eos).all() and (lengths[~eos_rows] == sampling.max_new_tokens).all()


def test_samples_are_reproducible_from_the_rng_state(smollm2, engine):
    _, _, prompts, _ = smollm2
    sampling = SamplingParams(max_new_tokens=16, n=3, temperature=1.0)
    a, b = (engine.generate(prompts, sampling, RngState(7), version=0) for _ in range(2))
    c = engine.generate(prompts, sampling, RngState(8), version=0)
    assert torch.equal(a.sequences.input_ids, b.sequences.input_ids)
    assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    assert not torch.equal(a.sequences.input_ids, c.sequences.input_ids)
    assert len({tuple(r) for r in a.sequences.responses()[:3].tolist()}) > 1  # one prompt's samples differ


def test_a_weight_sync_equals_a_fresh_engine_and_resets_the_prefix_cache(smollm2, long_prompts):
    model, params, _, eos = smollm2
    prompts = long_prompts
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g) for k, v in params.items()}
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, n=1)
    synced = _engine(model, eos)
    synced.sync(params, 0)
    before = synced.generate(prompts, greedy, RngState(0), version=0)  # fills the prefix cache
    synced.sync(new, 1)
    after = synced.generate(prompts, greedy, RngState(0), version=1)
    trainer = _trainer_logprobs(model, new, after, SamplingParams(temperature=1.0, n=1, max_new_tokens=128))
    assert (trainer - after.behaviour_logprobs)[after.sequences.response_mask].abs().max() <= 1e-4
    assert not torch.equal(before.sequences.input_ids, after.sequences.input_ids)

    synced._llm.reset_prefix_cache = lambda: None  # what a sync without the reset would give
    synced.sync(params, 2)
    stale = synced.generate(prompts, greedy, RngState(0), version=2)
    assert not torch.allclose(stale.behaviour_logprobs, before.behaviour_logprobs, atol=1e-3)
    synced.close()

    fresh = _engine(model, eos)
    fresh.sync(new, 1)
    again = fresh.generate(prompts, greedy, RngState(0), version=1)
    fresh.close()
    assert torch.equal(again.sequences.input_ids, after.sequences.input_ids)
    torch.testing.assert_close(again.behaviour_logprobs, after.behaviour_logprobs, rtol=0, atol=1e-5)


def test_a_batch_over_the_token_budget_samples_reproducibly(smollm2, long_prompts):
    """Prompts that do not all fit one scheduler step: on a CPU, a prompt prefilled in parts would
    crash a seeded request, so the engine prefills prompts whole."""
    model, params, _, eos = smollm2
    engine = make_engine("vllm", model, eos_token_ids=[eos], pad_token_id=eos, max_model_len=1024,
                         max_num_batched_tokens=1024)
    engine.sync(params, 0)
    sampling = SamplingParams(max_new_tokens=4, n=4, temperature=1.0)  # 12 requests × ~340 prompt tokens
    a, b = (engine.generate(long_prompts, sampling, RngState(3), version=0) for _ in range(2))
    engine.close()
    assert torch.equal(a.sequences.input_ids, b.sequences.input_ids) and len(a.sequences) == 12


def test_bad_syncs_and_versions_fail_naming_the_problem(smollm2, engine):
    model, params, prompts, _ = smollm2
    with pytest.raises(ValueError, match="model.extra.weight"):
        engine.sync({**params, "model.extra.weight": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="missing: \\['model.embed_tokens.weight'\\]"):
        engine.sync({k: v for k, v in params.items() if k != "model.embed_tokens.weight"}, 1)
    assert engine.version == 0
    with pytest.raises(RuntimeError, match="version 5"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, n=1), RngState(0), version=5)
    with pytest.raises(ValueError, match="stop strings"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, stop=("\n",), temperature=1.0, n=1), RngState(0))


JOB = ["--engine", "vllm", "--steps", "3", "--prompts-per-step", "2", "--samples-per-prompt", "2",
       "--max-new-tokens", "8", "--eval-size", "4", "--train-size", "20", "--eval-every", "3",
       "--checkpoint-every", "3", "--micro-batch", "4", "--no-progress"]


@pytest.mark.parametrize("executor", [["--executor", "local"],
                                      ["--executor", "ray", "--train-ranks", "1", "--rollout-workers", "1"],
                                      ["--executor", "ray", "--train-ranks", "1", "--rollout-workers", "1", "--async"]],
                         ids=["local", "ray", "ray-async"])
def test_a_grpo_loop_runs_three_steps_on_the_vllm_engine(tmp_path, executor):
    if executor[1] == "ray":
        pytest.importorskip("ray")
        executor = [*executor, "--ray-temp-dir", tempfile.mkdtemp(prefix="ray")]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "grpo_math.py"), *JOB, *executor,
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["config"]["rollout"]["engine"] == "vllm"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    if "--async" in executor:  # the rollout worker pulled published versions while the rank trained
        assert summary["async"]["trained"] == 3 and set(summary["async"]["staleness_histogram"]) <= {"0", "1"}
    if executor[1] == "local":  # engine and trainer agree in fp32
        assert all(r["rollout/logprob_gap_max"] < 1e-3 for r in rows)
    checked = [r["actor/sync_gap"] for r in rows if "actor/sync_gap" in r]  # the step's weight-sync check
    assert max(checked, default=0.0) < 1e-3, checked
    if "--async" not in executor:  # every synchronous batch was sampled by the weights its step starts from
        assert len(checked) == 3


def _tiny_qwen3(family: str):
    from transformers import Qwen3Config, Qwen3MoeConfig

    from purerl.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, initializer_range=0.1)
    if family == "qwen3":
        return Qwen3Config(**common), tokenizer
    return Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True), tokenizer


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_main_job_trains_a_tiny_qwen3_on_the_vllm_engine(tmp_path, family):
    """vLLM's CPU build runs Qwen3 dense: its log-probs are the lean trainer's (float32). It samples a
    Qwen3-MoE as the trainer computes it at the start, but its in-place reload leaves the experts
    stale: the probe after each sync of a model with experts stops the run at the first update,
    naming the version, where it would otherwise train on samples of the starting weights."""
    from purerl.models.hf import export_hf
    from purerl.tiny import tiny_causal_lm

    config, tokenizer = _tiny_qwen3(family)
    model, params = tiny_causal_lm(config, seed=0)
    folder = export_hf(model, params, tmp_path / family, tokenizer)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "grpo_math.py"), *JOB, "--model", str(folder),
                           "--threads", "1", "--out-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert f"computed by the lean family {family!r}" in done.stdout
    if family == "qwen3_moe":
        assert done.returncode != 0
        assert "the sync of weights version 1 did not take" in done.stderr, done.stderr[-3000:]
        return
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/logprob_gap_max"] < 1e-3 for r in rows), [r["rollout/logprob_gap_max"] for r in rows]


def test_stop_strings_cut_a_response_after_the_token_completing_one(smollm2):
    from transformers import AutoTokenizer

    model, params, prompts, eos = smollm2
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    engine = make_engine("vllm", model, eos_token_ids=[eos], pad_token_id=eos, decode=decode)
    engine.sync(params, 0)
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=24, stop=("e",), temperature=1.0, n=4),
                              RngState(0), version=0)
    engine.close()
    from purerl.batch import FINISH_STOP

    stopped = 0
    for row, reason in enumerate(rollout.finish_reasons.tolist()):
        ids = rollout.sequences.responses()[row][rollout.sequences.response_mask[row]].tolist()
        if reason == FINISH_STOP:
            stopped += 1
            assert "e" in decode(ids) and "e" not in decode(ids[:-1])
        else:
            assert "e" not in decode(ids)
    assert stopped > 0


def test_the_tool_math_job_runs_multi_turn_episodes_on_the_vllm_engine(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "tool_math.py"), "--engine", "vllm",
                           "--steps", "2",
                           "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "16",
                           "--eval-size", "2", "--train-size", "20", "--eval-every", "0", "--micro-batch", "4",
                           "--no-progress", "env.sft_steps=2", "env.sft_rows=4", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["episode/turns_mean"] >= 1 for r in rows)
    assert any(r["episode/tool_calls_mean"] > 0 for r in rows)  # the warm-up taught the call format
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "val/episode/turns_mean" in summary["final_evaluation"]


def test_a_lora_policy_syncs_its_adapters_alone_samples_the_adapted_policy_and_refuses_a_stale_adapter(smollm2):
    from purerl.models.lora import LoraSpec, apply_lora

    model, params, prompts, eos = smollm2
    lm, adapters = apply_lora(model, params, LoraSpec(8, 32.0))
    g = torch.Generator().manual_seed(0)
    trained = [{k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in adapters.items()} for _ in range(2)]
    sampling = SamplingParams(max_new_tokens=12, n=2, temperature=1.0)
    greedy = SamplingParams(max_new_tokens=12, n=1, temperature=0.0)
    engine = _engine(lm, eos)
    try:
        engine.sync(adapters, 0)  # vLLM starts on the base, LoRA enabled; the zero adapter is the base
        assert engine.adapter_sync and engine.last_probe_gap <= 1e-3
        base = engine.generate(prompts, greedy, RngState(0), version=0)
        for version, tree in enumerate(trained, start=1):
            engine.sync(tree, version)
            assert engine.last_probe_gap <= 1e-3
            rollout = engine.generate(prompts, sampling, RngState(version), version=version)
            gap = (_trainer_logprobs(lm, tree, rollout, sampling) - rollout.behaviour_logprobs)[
                rollout.sequences.response_mask].abs().max().item()
            assert gap <= 1e-3, (version, gap)  # sampled from the adapted policy of this version
        assert engine._llm.llm_engine.list_loras() == {3}  # older versions retired
        adapted = engine.generate(prompts, greedy, RngState(0), version=2)
        assert not torch.equal(adapted.sequences.input_ids, base.sequences.input_ids)

        # a sync whose adapter does not reach vLLM (here: the previous version's loaded again) stops
        load = engine._load_adapter
        engine._load_adapter = lambda tree, version: load(trained[0], version)
        stale = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in adapters.items()}
        with pytest.raises(RuntimeError, match="sync of weights version 3 did not take"):
            engine.sync(stale, 3)
    finally:
        engine.close()

    merged = make_engine("vllm", lm, eos_token_ids=[eos], pad_token_id=eos, lora_sync="merged")
    try:
        merged.sync(trained[1], 2)  # the fallback: the merged weights, loaded as a full model
        assert not merged.adapter_sync and merged.last_probe_gap <= 1e-3
        rollout = merged.generate(prompts, sampling, RngState(2), version=2)
        gap = (_trainer_logprobs(lm, trained[1], rollout, sampling) - rollout.behaviour_logprobs)[
            rollout.sequences.response_mask].abs().max().item()
        assert gap <= 1e-4, gap
    finally:
        merged.close()
