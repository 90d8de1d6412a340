"""The Tinker API served by purerl (:mod:`purerl.tinker`), driven by the unmodified ``tinker`` SDK.

One server per module, in-process on a free loopback port, over a tiny random Llama written with
purerl's character tokenizer to a temporary folder (so ``get_tokenizer`` stays offline), with the
SDK's telemetry off. The oracles are purerl's own functions on the same batch.
"""

import gc
import os
import warnings

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from purerl.algo.policy_loss import cispo_policy_loss, dro_policy_loss, ppo_clip_loss  # noqa: E402
from purerl.batch import Sequences  # noqa: E402
from purerl.loopback import is_loopback  # noqa: E402
from purerl.models import load_causal_lm, response_logprobs  # noqa: E402
from purerl.tinker.launch import service_of, write_tiny_model  # noqa: E402
from purerl.tinker.server import TinkerServer  # noqa: E402

# the sockets of the SDK's one-off client-config pool, which it never closes
pytestmark = pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")

TEXT = "the cat sat on the mat"
PROMPT = 8  # the first PROMPT tokens are the prompt, the rest the completion


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    saved = os.environ.get("TINKER_TELEMETRY")
    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("tinker")
    folder = write_tiny_model(root / "tiny")
    server = TinkerServer(service_of(folder, store=root / "store"), poll_seconds=5.0)
    client = tinker.ServiceClient(base_url=server.url, api_key=server.key)
    yield server, client, folder
    client.close("success").result()
    server.close()
    with warnings.catch_warnings():  # collect the SDK's unclosed sockets here, not in a later test
        warnings.simplefilter("ignore", ResourceWarning)
        del client
        gc.collect()
    if saved is None:
        os.environ.pop("TINKER_TELEMETRY", None)
    else:
        os.environ["TINKER_TELEMETRY"] = saved


@pytest.fixture(scope="module")
def oracle(served):
    """purerl's own model over the served folder, its tokenizer and the batch's tokens."""
    _, client, folder = served
    model, params = load_causal_lm(folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model, params, tokenizer, tokenizer.encode(TEXT)


def _purerl_logprobs(oracle) -> torch.Tensor:
    """``log p`` of the completion tokens, prompt ``tokens[:PROMPT]``, by purerl's policy forward."""
    model, params, _, tokens = oracle
    ids = torch.tensor([tokens])
    seqs = Sequences(ids, torch.ones_like(ids, dtype=torch.bool), torch.ones(1, len(tokens) - PROMPT, dtype=torch.bool))
    return response_logprobs(model, params, seqs)[0]


def _datum(tokens: list[int], **inputs: np.ndarray) -> types.Datum:
    """Tinker's shifted datum: input ``tokens[:-1]`` predicting ``tokens[1:]``."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), **inputs})


def _completion(values: np.ndarray, tokens: list[int]) -> np.ndarray:
    """``values`` on the completion's target positions, 0 on the prompt's."""
    out = np.zeros(len(tokens) - 1, np.float32)
    out[PROMPT - 1:] = values
    return out


def _training_client(served, **lora):
    _, client, folder = served
    return client.create_lora_training_client(base_model=str(folder), rank=4, **lora).result()


def test_quickstart_trains_saves_for_the_sampler_and_samples(served, oracle):
    _, _, tokenizer, tokens = oracle
    training = _training_client(served)
    assert training.get_tokenizer().encode(TEXT) == tokens  # the served folder's tokenizer, offline
    weights = _completion(np.ones(len(tokens) - PROMPT, np.float32), tokens)
    data = [_datum(tokens, weights=weights)]
    losses = []
    for _ in range(3):
        fwdbwd = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fwdbwd.result().metrics["loss:sum"])
        optim.result()
    assert losses[-1] < losses[0]  # the adapters learn the completion
    path = training.save_weights_for_sampler("quickstart").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/quickstart")
    sampling = served[1].create_sampling_client(model_path=path).result()
    prompt = types.ModelInput.from_ints(tokens[:PROMPT])
    result = sampling.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    assert len(result.sequences) == 3
    for sequence in result.sequences:
        assert 1 <= len(sequence.tokens) <= 6 and len(sequence.logprobs) == len(sequence.tokens)
        assert all(lp <= 0 for lp in sequence.logprobs) and sequence.sequence_id
    again = sampling.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]  # seeded
    # an immutable snapshot: training on does not change what the saved weights sample
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    after = sampling.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    assert [s.logprobs for s in after.sequences] == [s.logprobs for s in result.sequences]


def test_cross_entropy_loss_and_logprobs_equal_purerls_on_the_same_batch(served, oracle):
    _, _, _, tokens = oracle
    training = _training_client(served)  # a new model computes its base exactly (B = 0)
    expected = _purerl_logprobs(oracle)
    weights = _completion(np.linspace(0.5, 1.5, len(tokens) - PROMPT, dtype=np.float32), tokens)
    out = training.forward_backward([_datum(tokens, weights=weights)], "cross_entropy").result()
    logprobs = torch.tensor(out.loss_fn_outputs[0]["logprobs"].data)
    assert logprobs.shape == (len(tokens) - 1,)
    torch.testing.assert_close(logprobs[PROMPT - 1:], expected, rtol=1e-5, atol=1e-5)
    loss = -(expected * torch.from_numpy(weights[PROMPT - 1:])).sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-5, abs=1e-5)
    forward = training.forward([_datum(tokens, weights=weights)], "cross_entropy").result()
    assert forward.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-6)


def _rl_batch(oracle):
    _, _, _, tokens = oracle
    n = len(tokens) - PROMPT
    generator = torch.Generator().manual_seed(3)
    behaviour = _purerl_logprobs(oracle) + 0.3 * torch.randn(n, generator=generator)  # an off-policy sampler
    advantages = torch.randn(n, generator=generator)
    return tokens, behaviour, advantages


@pytest.mark.parametrize("loss_fn, config", [
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.05}),
])
def test_policy_losses_equal_purerls_on_the_same_batch(served, oracle, loss_fn, config):
    tokens, behaviour, advantages = _rl_batch(oracle)
    data = [_datum(tokens, logprobs=_completion(behaviour.numpy(), tokens),
                   advantages=_completion(advantages.numpy(), tokens))]
    out = _training_client(served).forward_backward(data, loss_fn, config).result()
    p, q, a = _purerl_logprobs(oracle)[None], behaviour[None], advantages[None]
    mask = torch.ones_like(p, dtype=torch.bool)
    low, high = (config or {}).get("clip_low_threshold", 0.8), (config or {}).get("clip_high_threshold", 1.2)
    if loss_fn == "importance_sampling":  # the unclipped surrogate: no ratio here comes near the bounds
        expected = ppo_clip_loss(p, q, a, mask, clip_low=1.0, clip_high=1e6, clip_c=None, agg="token-sum").loss
    elif loss_fn == "ppo":
        expected = ppo_clip_loss(p, q, a, mask, clip_low=1 - low, clip_high=high - 1, clip_c=None,
                                 agg="token-sum").loss
    elif loss_fn == "cispo":
        expected = cispo_policy_loss(p, q, a, mask, clip_low=1 - low, clip_high=high - 1, loss_agg="token-sum",
                                     loss_norm=None).loss
    else:  # dro: the prompt positions count too, with q = 0 there (Tinker's sum over all tokens)
        prompt_logp = torch.tensor(out.loss_fn_outputs[0]["logprobs"].data[: PROMPT - 1])[None]
        p, q = torch.cat([prompt_logp, p], 1), torch.cat([torch.zeros_like(prompt_logp), q], 1)
        a, mask = torch.cat([torch.zeros_like(prompt_logp), a], 1), torch.ones_like(p, dtype=torch.bool)
        expected = dro_policy_loss(p, q, a, mask, dro_beta=config["beta"], loss_agg="token-sum", loss_norm=None).loss
    assert out.metrics["loss:sum"] == pytest.approx(float(expected.total), rel=1e-5, abs=1e-5)


def test_a_wrong_key_is_refused(served):
    server, _, folder = served
    wrong = tinker.ServiceClient(base_url=server.url, api_key="tml-not-the-key")
    with pytest.raises(tinker.APIStatusError) as refused:
        wrong.create_lora_training_client(base_model=str(folder), rank=4).result()
    assert refused.value.status_code == 401
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del wrong
        gc.collect()


def test_callers_outside_loopback_are_refused(served):
    from starlette.testclient import TestClient

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("127.3.4.5")
    assert not is_loopback("10.0.0.7") and not is_loopback("192.168.1.2") and not is_loopback("testclient")
    server = served[0]
    with TestClient(server.app) as outsider:  # its requests come from the host "testclient", not loopback
        response = outsider.post("/api/v1/create_session", json={}, headers={"X-API-Key": server.key})
    assert response.status_code == 403 and "loopback" in response.json()["error"]


@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "custom", "gspo"])
def test_an_unsupported_loss_is_refused_in_one_line(served, oracle, loss_fn):
    _, _, _, tokens = oracle
    training = _training_client(served)
    data = [_datum(tokens, weights=np.ones(len(tokens) - 1, np.float32))]
    with pytest.raises(tinker.RequestFailedError) as refused:
        training.forward_backward(data, loss_fn).result()
    message = str(refused.value)
    assert f"loss_fn {loss_fn!r} is not supported" in message and "\n" not in message
    # the refusal took its turn: the model's next call runs
    assert training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] > 0


def test_prompt_logprobs_are_refused_in_one_line(served, oracle):
    _, client, folder = served
    tokens = oracle[3]
    sampling = client.create_sampling_client(base_model=str(folder)).result()
    with pytest.raises(tinker.RequestFailedError) as refused:
        sampling.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=2),
                        include_prompt_logprobs=True).result()
    assert "prompt_logprobs is not served" in str(refused.value) and "\n" not in str(refused.value)


def test_sampled_logprobs_equal_the_learners_at_temperature_one_after_training(served, oracle):
    # the output-layer adapter (train_unembed, the SDK's default) and the layer adapters both reach the sampler
    _, _, _, tokens = oracle
    training = _training_client(served)
    data = [_datum(tokens)]
    for _ in range(2):
        training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampling = training.save_weights_and_get_sampling_client().result()
    prompt = tokens[:PROMPT]
    result = sampling.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=1)).result()
    for sequence in result.sequences:
        full = prompt + sequence.tokens
        learner = training.forward([_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
        torch.testing.assert_close(torch.tensor(learner[PROMPT - 1:]), torch.tensor(sequence.logprobs),
                                   rtol=1e-5, atol=1e-5)


def test_provenance_spans_are_accepted_and_change_nothing(served, oracle):
    # the cookbook attaches them to every sampled datum; no served loss reads them
    tokens, behaviour, advantages = _rl_batch(oracle)
    plain = _datum(tokens, logprobs=_completion(behaviour.numpy(), tokens),
                   advantages=_completion(advantages.numpy(), tokens))
    n = len(tokens) - 1
    spans = plain.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s", length=PROMPT),
                     types.SampledProvenanceSpan(sequence_id="s", length=n - PROMPT)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s", length=PROMPT - 1),
                        types.SampledProvenanceSpan(sequence_id="s", length=n - PROMPT + 1)])
    training = _training_client(served)
    with_spans = training.forward([spans], "importance_sampling").result().metrics["loss:sum"]
    assert with_spans == training.forward([plain], "importance_sampling").result().metrics["loss:sum"]


def _rest_client(server):
    return tinker.RestClient(base_url=server.url, api_key=server.key)


def _train_step(training, tokens, learning_rate=5e-2):
    training.forward_backward([_datum(tokens)], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()


def _loss(training, tokens) -> float:
    return training.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]


def test_a_run_resumes_from_its_checkpoint_with_its_optimizer_state(served, oracle):
    # the cookbook's resume: GET training_runs/{id} for the renderer, then load_weights with the optimizer
    server, client, folder = served
    tokens = oracle[3]
    metadata = {"renderer_name": "role_colon"}
    first = client.create_lora_training_client(base_model=str(folder), rank=4, user_metadata=metadata).result()
    for _ in range(2):
        _train_step(first, tokens)
    path = first.save_state("resume-me").result().path
    assert path.endswith("/weights/resume-me")
    rest = _rest_client(server)
    run = rest.get_training_run_by_tinker_path(path).result()
    assert run.training_run_id == first.model_id and run.user_metadata == metadata
    assert run.is_lora and run.lora_rank == 4 and run.base_model == str(folder)
    assert run.last_checkpoint.tinker_path == path and run.last_checkpoint.checkpoint_type == "training"
    listed = rest.list_checkpoints(first.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [path] and listed[0].size_bytes > 0
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.is_lora and info.lora_rank == 4 and info.train_unembed and info.base_model == str(folder)
    resumed = client.create_training_client_from_state_with_optimizer(path, user_metadata=metadata).result()
    fresh_optimizer = client.create_training_client_from_state(path).result()
    assert _loss(resumed, tokens) == _loss(first, tokens) == _loss(fresh_optimizer, tokens)
    for training in (first, resumed, fresh_optimizer):
        _train_step(training, tokens)
    assert _loss(resumed, tokens) == pytest.approx(_loss(first, tokens), rel=1e-6)  # the same step: moments restored
    assert _loss(fresh_optimizer, tokens) != pytest.approx(_loss(first, tokens), rel=1e-3)  # fresh moments differ
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(f"{first.model_id}-unknown").result()
    rest.delete_checkpoint(first.model_id, "weights/resume-me").result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(path).result()


def test_a_restarted_server_knows_the_runs_in_its_store(served, oracle):
    server, client, folder = served
    tokens = oracle[3]
    training = client.create_lora_training_client(base_model=str(folder), rank=4,
                                                  user_metadata={"renderer_name": "role_colon"}).result()
    _train_step(training, tokens)
    path = training.save_state("before-restart").result().path
    sampler_path = training.save_weights_for_sampler("before-restart").result().path
    expected = _loss(training, tokens)
    with TinkerServer(service_of(folder, store=server.service.store.root), poll_seconds=5.0) as again:
        other = tinker.ServiceClient(base_url=again.url, api_key=again.key)
        run = _rest_client(again).get_training_run_by_tinker_path(path).result()
        assert run.user_metadata == {"renderer_name": "role_colon"} and run.lora_rank == 4
        assert run.last_checkpoint.tinker_path == path and run.last_sampler_checkpoint.tinker_path == sampler_path
        resumed = other.create_training_client_from_state_with_optimizer(path).result()
        assert _loss(resumed, tokens) == pytest.approx(expected, rel=1e-6)
        other.close("success").result()


def test_the_served_folder_is_the_model_folder_or_a_ggufs_conversion(served, tmp_path):
    from purerl.tinker.launch import model_folder

    folder = served[2]
    assert model_folder(folder) == folder
    (tmp_path / "weights.bin").write_bytes(b"")
    for wrong in (tmp_path / "weights.bin", tmp_path / "missing"):
        with pytest.raises(ValueError, match="not a model folder or a .gguf file"):
            model_folder(wrong)


def test_training_calls_run_in_seq_id_order_once_each_within_a_bounded_queue():
    import asyncio

    from purerl.tinker.futures import Futures, QueueFull

    async def scenario():
        futures = Futures(asyncio.get_running_loop(), capacity=3, poll_seconds=5.0)
        ran = []
        third = futures.submit_ordered("m", 3, lambda: ran.append(3) or 3)  # arrives first, waits for 1 and 2
        second = futures.submit_ordered("m", 2, lambda: ran.append(2) or 2)
        assert futures.submit_ordered("m", 3, lambda: ran.append(33)) == third  # a retried submission
        first = futures.submit_ordered("m", 1, lambda: ran.append(1) or 1)
        results = [await futures.retrieve(r) for r in (first, second, third)]
        assert ran == [1, 2, 3] and results == [(True, 1), (True, 2), (True, 3)]
        for seq in (5, 6, 7):  # 4 never comes: these wait, and fill the queue
            futures.submit_ordered("m", seq, lambda: None)
        with pytest.raises(QueueFull):
            futures.submit_ordered("m", 8, lambda: None)
        futures.close()

    asyncio.run(scenario())


def test_waiting_sample_requests_of_one_key_run_together_and_a_refusal_stays_with_its_request():
    import asyncio
    import threading

    from purerl.tinker.futures import Batched, Failure, Futures

    async def scenario():
        futures = Futures(asyncio.get_running_loop(), poll_seconds=5.0,
                          refuse=lambda err: Failure(str(err)) if isinstance(err, ValueError) else None)
        gate, batches = threading.Event(), []

        def run(items):
            batches.append(list(items))
            return [ValueError(f"bad {i}") if i < 0 else i * 10 for i in items]

        futures.run(gate.wait)  # the worker is busy: what follows waits together
        a = [futures.submit_batched(Batched("a", i, run)) for i in (1, -2, 3)]
        b = futures.submit_batched(Batched("b", 7, run))
        a.append(futures.submit_batched(Batched("a", 4, run)))
        gate.set()
        results = [await futures.retrieve(r) for r in (*a, b)]
        assert batches == [[1, -2, 3, 4], [7]]  # one call per key, in arrival order
        assert results == [(True, 10), (True, Failure("bad -2")), (True, 30), (True, 40), (True, 70)]
        futures.close()

    asyncio.run(scenario())


def test_prompts_sampled_in_one_call_each_get_their_samples_and_a_bad_prompt_is_refused_alone(served):
    from purerl.tinker.sampler import SamplingRequest

    sampler, service = served[0].service.sampler, served[0].service
    base = service.snapshots[0]
    vocab = sampler.base.config.vocab_size
    prompts = [[5, 6, 7], [8, 9], [vocab + 3], [5, 6, 7, 8, 9, 10]]
    request = SamplingRequest(max_tokens=5, temperature=1.0, seed=11)
    batched = sampler.sample_many(base, prompts, 3, request)
    assert isinstance(batched[2], ValueError) and "vocabulary" in str(batched[2])
    for prompt, samples in zip(prompts, batched, strict=True):
        if prompt[0] < vocab:
            assert len(samples) == 3 and all(1 <= len(s.ids) <= 5 for s in samples)
            assert all(len(s.logprobs) == len(s.ids) for s in samples)
    alone = sampler.sample(base, prompts[0], 3, request)  # the first prompt draws the same alone
    assert [s.ids for s in alone] == [s.ids for s in batched[0]]


def test_a_batch_whose_work_returns_the_wrong_number_of_results_fails_each_request_in_one_line():
    import asyncio
    import threading

    from purerl.tinker.futures import Batched, Futures

    async def scenario():
        futures, gate = Futures(asyncio.get_running_loop(), poll_seconds=5.0), threading.Event()
        futures.run(gate.wait)  # the worker is busy: the three wait together
        ids = [futures.submit_batched(Batched("k", i, lambda items: items[:1])) for i in range(3)]
        gate.set()
        results = [await futures.retrieve(r) for r in ids]
        futures.close()
        return results

    for done, failure in asyncio.run(scenario()):
        assert done and failure.category == "server" and "got 1 results" in failure.error


def test_json_answers_are_the_sdks_response_types_holding_only_what_the_server_states():
    """The server builds its JSON answers as the SDK's types (:func:`purerl.tinker.wire.json_answer`): what it
    sets, no default it does not state (``GetInfoResponse.optimizer_config``, the sampler save's ``path``)."""
    from purerl.tinker.wire import json_answer

    info = types.GetInfoResponse(type="get_info", model_id="m", model_name="n", is_lora=False, lora_rank=None,
                                 model_data=types.ModelData(arch="llama", model_name="n", tokenizer_id="/t"))
    assert json_answer(info) == {"type": "get_info", "model_id": "m", "model_name": "n", "is_lora": False,
                                 "lora_rank": None,
                                 "model_data": {"arch": "llama", "model_name": "n", "tokenizer_id": "/t"}}
    saved = types.SaveWeightsForSamplerResponseInternal(type="save_weights_for_sampler", sampling_session_id="s")
    assert json_answer(saved) == {"type": "save_weights_for_sampler", "sampling_session_id": "s"}
    assert json_answer(types.OptimStepResponse(metrics={"grad_norm:mean": 2.5})) == {"metrics": {"grad_norm:mean": 2.5}}
