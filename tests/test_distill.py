"""On-policy distillation in a step and in the job: a teacher's scores, its advantage and loss term,
what a student equal to its teacher does, learning from a fixed teacher, refusals."""

import attrs
import pytest
import torch

from purerl.algo.kl_control import make_kl_controller
from purerl.assembly.models import load_policy, load_teacher
from purerl.assembly.stages import stage_settings_of
from purerl.data.records import DataError
from purerl.models import response_logits
from purerl.models.hf import export_hf
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.step import grpo_step
from purerl.step.experience import TeacherScores, teacher_scores
from purerl.step.roles import LocalTeacher
from purerl.step.settings import Batching, DistillAdvantage, DistillLoss
from purerl.tiny import tiny_causal_lm, tiny_llama_config
from purerl.tree import tree_clone, tree_equal
from tests.jobs import SMALL, parse, run_job, step_config, tiny_teacher

CONFIG = tiny_llama_config()
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]


class FixedTeacher:
    """A teacher whose next-token distribution is the same everywhere: most of its mass on five
    tokens. Its top-k is its whole vocabulary, likeliest first."""

    def __init__(self, vocab: int) -> None:
        logits = torch.zeros(vocab)
        logits[10:15] = 5.0
        self.logp = torch.log_softmax(logits, -1)

    def scores(self, seqs, *, temperature, batching, top_k):
        mask = seqs.response_mask
        logp = torch.where(mask, self.logp[seqs.responses()], 0.0)
        if top_k is None:
            return TeacherScores(logp)
        top = self.logp.topk(len(self.logp))
        shape = (*mask.shape, len(self.logp))
        return TeacherScores(logp, top.indices.expand(shape), top.values.expand(shape))


def _student(lr=1e-2):
    model, params = tiny_causal_lm(CONFIG, seed=0)
    optimizer = chain(clip_by_global_norm(1.0), adamw(lr, weight_decay=0.0))
    kl = make_kl_controller("fixed", coef=0.0)
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl.init(), rng=RngState(0))
    return model, optimizer, kl, state, TorchEngine(model, eos_token_ids=[1], pad_token_id=0)


def _settings(advantage=DistillAdvantage(), loss=None, top_k=None):
    settings = stage_settings_of(step_config(recompute_old_logprobs=True))
    settings["shaping"] = attrs.evolve(settings["shaping"], distill=advantage)
    settings["loss"] = attrs.evolve(settings["loss"], distill=loss)
    settings["experience"] = attrs.evolve(settings["experience"], teacher_top_k=top_k)
    return settings


def _distil(teacher, settings, steps):
    model, optimizer, kl, state, engine = _student()
    history = []
    for step in range(steps):
        engine.sync(state.policy, step)
        rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(100 + step))
        state, metrics = grpo_step(state, rollout, torch.zeros(len(rollout.sequences)), policy=model,
                                   optimizer=optimizer, kl_controller=kl, teacher=teacher, **settings)
        history.append(metrics)
    return history


def test_a_student_equal_to_its_teacher_gets_zero_advantage_and_keeps_its_params():
    model, optimizer, kl, state, engine = _student()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    before = tree_clone(state.policy)
    teacher = LocalTeacher(model, tree_clone(state.policy))
    state, metrics = grpo_step(state, rollout, torch.rand(len(rollout.sequences)), policy=model, optimizer=optimizer,
                               kl_controller=kl, teacher=teacher, **_settings())
    assert metrics["distill/reverse_kl"] == 0.0
    assert metrics["critic/advantages/max"] == 0.0 and metrics["critic/advantages/min"] == 0.0
    assert tree_equal(state.policy, before)  # no gradient, and AdamW without decay moves nothing


@pytest.mark.slow
def test_the_reverse_kl_to_a_fixed_teacher_falls_over_the_steps():
    history = _distil(FixedTeacher(CONFIG.vocab_size), _settings(), steps=20)
    kl = [m["distill/reverse_kl"] for m in history]
    assert sum(kl[:3]) / 3 > 1.0, kl
    assert sum(kl[-3:]) / 3 < 0.3 * sum(kl[:3]) / 3, kl
    assert history[-1]["distill/teacher_logprob"] > history[0]["distill/teacher_logprob"] + 1.0


def test_gkds_jsd_loss_alone_moves_the_student_towards_a_fixed_teacher():
    settings = _settings(DistillAdvantage(coef=0.0), DistillLoss(coef=1.0, beta=0.5), top_k=0)
    history = _distil(FixedTeacher(CONFIG.vocab_size), settings, steps=10)
    loss = [m["actor/distill_loss"] for m in history]
    assert loss[-1] < 0.5 * loss[0], loss
    assert all(m["critic/advantages/max"] == 0.0 for m in history)  # the loss term alone trained it


def test_off_policy_distillation_is_sft_on_the_teachers_samples(tiny_lm):
    """The teacher samples with an engine of its own; ``sft_step`` fits the student to those
    sequences (docs/guides/distillation.md's off-policy variant): their NLL under the student falls."""
    from purerl.step.sft import sft_step

    model, optimizer, _, state, _ = _student(lr=1e-2)
    teacher_model, teacher_params = tiny_lm(CONFIG, seed=1)
    teacher_params = {k: v * 20 if k == "model.norm.weight" else v for k, v in teacher_params.items()}  # peaked
    teacher_engine = TorchEngine(teacher_model, eos_token_ids=[1], pad_token_id=0)
    teacher_engine.sync(teacher_params, 0)
    losses = []
    for step in range(8):
        rollout = teacher_engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0),
                                          RngState(50 + step))
        state, metrics = sft_step(state, rollout.sequences, policy=model, optimizer=optimizer)
        losses.append(metrics["sft/loss"])
    assert losses[-1] < 0.7 * losses[0], losses


def test_teacher_scores_in_micro_batches_and_token_budgets_equal_the_whole_batch(tiny_lm):
    model, params = tiny_lm(CONFIG, seed=3)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    seqs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=3, temperature=1.0), RngState(2)).sequences
    whole = teacher_scores(model, params, seqs, temperature=0.7, batching=Batching(micro_batch_rows=64), top_k=5)
    full = torch.log_softmax(model.map_rows(lambda part: response_logits(model, params, part), seqs) / 0.7, -1)
    mask = seqs.response_mask
    top = full.topk(5, dim=-1)
    assert torch.equal(whole.top_ids[mask], top.indices[mask])
    torch.testing.assert_close(whole.top_logprobs[mask], top.values[mask], rtol=0, atol=1e-5)
    for batching in (Batching(micro_batch_rows=2), Batching(micro_batch_rows=4, max_tokens=40)):
        part = teacher_scores(model, params, seqs, temperature=0.7, batching=batching, top_k=5)
        torch.testing.assert_close(part.logprobs[mask], whole.logprobs[mask], rtol=0, atol=1e-5)
        assert torch.equal(part.top_ids[mask], whole.top_ids[mask])


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tiny_lm, tmp_path):
    model, params = tiny_lm(vocab_size=50, hidden_size=64, seed=1)
    other = export_hf(model, params, tmp_path / "other")
    config = parse(["--tiny", "--teacher", str(other)]).config
    student, _, tokenizer = load_policy(config)
    with pytest.raises(DataError) as err:
        load_teacher(config, student, tokenizer)
    message = str(err.value)
    assert "\n" not in message and str(other) in message and "50 tokens" in message and "tokenizer" in message


def test_a_teacher_whose_vocabulary_differs_only_in_padding_rows_scores_the_policys_tokens(tiny_lm, tmp_path):
    from purerl.tiny import char_tokenizer

    tokens = len(char_tokenizer())
    config = parse(["--tiny", "--teacher", str(tiny_teacher(tmp_path / "same"))]).config
    student, _, tokenizer = load_policy(config)
    model, params = tiny_lm(vocab_size=tokens, hidden_size=64, seed=5)
    padded_model, _ = tiny_lm(vocab_size=tokens + 64, hidden_size=64, seed=5)
    padded = {k: torch.cat([v, torch.randn(64, *v.shape[1:])]) if v.shape[0] == tokens else v
              for k, v in params.items()}  # 64 padding rows, as one family's larger models carry
    folder = export_hf(padded_model, padded, tmp_path / "padded")
    char_tokenizer().save_pretrained(folder)
    config = parse(["--tiny", "--teacher", str(folder)]).config
    teacher = load_teacher(config, student, tokenizer)
    assert teacher.vocab == student.config.vocab_size == tokens
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    seqs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=2, temperature=1.0), RngState(2)).sequences
    got = teacher.scores(seqs, temperature=0.7, batching=Batching(micro_batch_rows=64), top_k=0)
    want = teacher_scores(model, params, seqs, temperature=0.7, batching=Batching(micro_batch_rows=64), top_k=0)
    mask = seqs.response_mask
    assert got.top_ids.shape[-1] == tokens and torch.equal(got.top_ids[mask], want.top_ids[mask])
    torch.testing.assert_close(got.logprobs[mask], want.logprobs[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.top_logprobs[mask], want.top_logprobs[mask], rtol=0, atol=1e-5)


def test_a_teacher_whose_tokenizer_maps_other_ids_is_refused(tmp_path):
    import json

    from purerl.tiny import char_tokenizer

    teacher = tiny_teacher(tmp_path / "teacher")
    char_tokenizer().save_pretrained(teacher)
    saved = json.loads((teacher / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # the same size, two tokens swapped
    (teacher / "tokenizer.json").write_text(json.dumps(saved))
    config = parse(["--tiny", "--teacher", str(teacher)]).config
    student, _, tokenizer = load_policy(config)
    with pytest.raises(DataError, match="maps tokens to other ids") as err:
        load_teacher(config, student, tokenizer)
    assert "\n" not in str(err.value)


def test_a_teacher_nothing_uses_and_a_missing_teacher_are_config_errors(tmp_path):
    from purerl.config.loading import ConfigError

    with pytest.raises((ConfigError, SystemExit)):
        parse(["--tiny", "--teacher", str(tmp_path / "absent")])
    teacher = tiny_teacher(tmp_path / "teacher")
    with pytest.raises((ConfigError, SystemExit)):
        parse(["--tiny", "--teacher", str(teacher), "distill.coef=0"])


@pytest.mark.parametrize("mode", ["sync", "async", "lora_packed"])
def test_the_job_distils_from_a_teacher_with_both_signals(tmp_path, mode):
    teacher = tiny_teacher(tmp_path / "teacher")
    extra = {"sync": [], "async": ["--async", "--max-staleness", "1"],
             "lora_packed": ["--lora-rank", "4", "actor.packed_forwards=true", "actor.max_tokens_per_micro_batch=64"]
             }[mode]
    summary = run_job(["--tiny", *SMALL, "--steps", "3", "--teacher", str(teacher), "distill.loss_coef=0.5",
                       "distill.top_k=8", "distill.reward_coef=1.0", *extra, "--out-dir", str(tmp_path / "run")])
    for record in summary["records"]:
        assert record["distill/reverse_kl"] > 0 and record["distill/teacher_logprob"] < 0
        assert record["actor/distill_loss"] > 0


def _distil_step_fn():
    """Built on each rank (under jaxtyping's import hook purerl's closures do not pickle)."""
    import functools

    from purerl.config.job import JobConfig
    from purerl.config.loading import build

    config = build(JobConfig, {"rollout": {"temperature": 1.0}, "actor": {"clip_high": 0.2, "micro_batch_rows": 4,
                                                                          "recompute_old_logprobs": True},
                               "distill": {"teacher": "t", "reward_coef": 1.0, "loss_coef": 0.5, "top_k": 6}})
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.0))
    return functools.partial(grpo_step, optimizer=optimizer, kl_controller=make_kl_controller("fixed", coef=0.0),
                             **stage_settings_of(config)), optimizer


@pytest.mark.slow
@pytest.mark.parametrize("placement, ranks", [("split", 2), ("standalone", 1)])
def test_the_teachers_scores_agree_on_the_training_ranks_and_on_a_pool_of_its_own(tiny_lm, ray_cluster, tmp_path, placement,
                                                                                   ranks):
    """``split``: the teacher is sharded over the 2 training ranks; ``standalone``: over the
    reference's pool. Its log-probs feed the advantages, the metrics and the loss term, so the
    step's metrics and params agree with the local executor's to 1e-5."""
    import sys

    from ray import cloudpickle

    from purerl.config.job import ExecutorConfig
    from purerl.executors.base import Roles
    from purerl.executors.local import LocalExecutor
    from purerl.executors.ray import RayExecutor, RaySetup, StepFactory

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import tests/
    model, params = tiny_lm(CONFIG, seed=0)
    teacher_model, teacher_params = tiny_lm(CONFIG, seed=1)
    teacher = LocalTeacher(teacher_model, {k: v * 5 if k == "model.norm.weight" else v
                                           for k, v in teacher_params.items()})
    step_fn, optimizer = _distil_step_fn()

    def fresh():
        p = tree_clone(params)
        return TrainState(policy=p, policy_opt=optimizer.init(p), kl=make_kl_controller("fixed", coef=0.0).init(),
                          rng=RngState(0))

    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=3, temperature=1.0), RngState(4))
    scores = torch.rand(len(rollout.sequences), generator=torch.Generator().manual_seed(0))
    local = LocalExecutor(step_fn, Roles(model, teacher=teacher), engine)
    want_state, want = local.step(fresh(), rollout, scores)
    config = ExecutorConfig(kind="ray", placement=placement, train_ranks=ranks, rollout_workers=1, step_timeout=120)
    with RayExecutor(StepFactory(lambda: _distil_step_fn()[0]), Roles(model, teacher=teacher),
                     RaySetup(engine_kwargs=dict(eos_token_ids=[1], pad_token_id=0)), config) as executor:
        state = executor.start(fresh())
        state, got = executor.step(state, rollout, scores)
        got_state = executor.full_state(state)
        labels = {label.rsplit(" ", 1)[0] for _, label in executor.groups.actors}
    assert ("reference rank" in labels) == (placement == "standalone")
    for key in ("distill/reverse_kl", "distill/teacher_logprob", "actor/distill_loss", "actor/pg_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for name, value in want_state.policy.items():
        torch.testing.assert_close(got_state.policy[name], value, rtol=0, atol=1e-5)


def test_a_swapped_teacher_is_named_on_replay_and_on_resume(tmp_path):
    import shutil

    from purerl.io.run_folder import RunFolderError
    from purerl.replay import ReplayError, replay

    teacher = tiny_teacher(tmp_path / "teacher")
    out = tmp_path / "run"
    argv = ["--tiny", *SMALL, "--teacher", str(teacher), "--checkpoint-every", "1", "--out-dir", str(out)]
    run_job([*argv, "--steps", "2"])
    shutil.rmtree(teacher)
    tiny_teacher(teacher, seed=7)  # other weights at the same path
    with pytest.raises(ReplayError, match=r"distill.teacher .*: its weights are not the ones this run trained"):
        replay(out, out=lambda line: None)
    with pytest.raises(RunFolderError, match=r"distill.teacher .*: its weights are not the ones this run trained"):
        run_job([*argv, "--steps", "3", "--resume"])
