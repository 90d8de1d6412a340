"""What the Tinker server keeps and does: sessions, training models, sampler snapshots, checkpoints.

One frozen base model (``name``: what ``base_model`` must say) is shared by every training model
(:mod:`purerl.tinker.trainer`) and by the sampler (:mod:`purerl.tinker.sampler`). The methods named
after Tinker calls run on the queue's worker thread (:mod:`purerl.tinker.futures`) and return what
the call answers (the JSON of the SDK's response type, :func:`~purerl.tinker.wire.json_answer`; bytes
for protobuf); a request they cannot honour raises
``ValueError`` in one line. Model ids are ``<session>:train:<n>`` (the SDK derives them so for
create-via-load) and sampling sessions ``<session>:sample:<n>``. What one request may cost is
bounded by :class:`~purerl.tinker.limits.Limits`; :meth:`Service.admitted` checks a request against
them, and its names against the store's rules, before it is queued.
"""

import itertools
import uuid
from collections.abc import Hashable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import torch
from tinker import types

from purerl.models import CausalLM, Params
from purerl.models.special_ids import special_ids
from purerl.tinker import runs, wire
from purerl.tinker.futures import Batched
from purerl.tinker.limits import Limits
from purerl.tinker.losses import bound_config, loss_of
from purerl.tinker.sampler import Sampler, SamplingRequest, Snapshot
from purerl.tinker.store import Store, check_model_id, check_name, parse_path, tinker_path
from purerl.tinker.trainer import (
    LoraSettings,
    ModelState,
    Trainable,
    batch_of,
    forward_backward,
    make_trainable,
    new_state,
    optim_step,
)

__all__ = ["Service", "TrainingModel"]


@attrs.define(eq=False)
class TrainingModel:
    """A training client's model: its resource and its values (replaced by each call), the
    ``user_metadata`` it was created with and the time of its last call."""

    model_id: str
    session_id: str
    trainable: Trainable
    state: ModelState
    user_metadata: dict[str, str] | None = None
    last_request: datetime = attrs.Factory(lambda: datetime.now(UTC))


class Service:
    """The server's state over ``base`` (``base_params``) named ``name``, whose tokenizer lives in
    ``tokenizer_dir``; LoRA scale ``lora_alpha / rank``; what a request may cost bounded by
    ``limits``; checkpoints under ``store``."""

    def __init__(self, name: str, base: CausalLM, base_params: Params, tokenizer: Any, *, tokenizer_dir: str,
                 store: str | Path, device: torch.device, lora_alpha: float = 32.0,
                 limits: Limits = Limits()) -> None:  # noqa: B008 - frozen
        self.name, self.base, self.base_params, self.tokenizer_dir = name, base, base_params, tokenizer_dir
        self.device, self.lora_alpha, self.limits, self.store = device, lora_alpha, limits, Store(store)
        self.vocab = int(base.config.vocab_size)
        self.context = int(getattr(base.config, "max_position_embeddings", 2048))
        ids = special_ids(base.config, tokenizer)
        self.sampler = Sampler(base, base_params, eos_ids=list(ids.eos), decode=tokenizer.decode, pad_id=ids.pad,
                               context=self.context,
                               device=device, max_new_tokens=limits.max_tokens)
        self.sessions: dict[str, bool] = {}  # id -> finished
        self.models: dict[str, TrainingModel] = {}
        self.snapshots: dict[int, Snapshot] = {0: Snapshot(0, None, {})}
        self.by_path: dict[str, int] = {}
        self.samplers: dict[str, int] = {}
        self._numbers = itertools.count(1)

    # sessions and information (answered on the event loop)

    def create_session(self) -> str:
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = False
        return session_id

    def finish_session(self, session_id: str) -> list[str]:
        """Mark ``session_id`` finished and unload its training models; their ids (``KeyError``: a
        session this server never opened)."""
        if session_id not in self.sessions:
            raise KeyError(session_id)
        self.sessions[session_id] = True
        gone = [m for m, model in self.models.items() if model.session_id == session_id]
        for model_id in gone:
            del self.models[model_id]
        return gone

    def model(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise ValueError(f"model {model_id!r} is not loaded on this server")
        model = self.models[model_id]
        model.last_request = datetime.now(UTC)
        return model

    def info(self, model_id: str) -> dict[str, Any]:
        model = self.model(model_id)
        lora = model.trainable.lora
        return wire.json_answer(types.GetInfoResponse(
            type="get_info", model_id=model_id, model_name=self.name, is_lora=lora is not None,
            lora_rank=None if lora is None else lora.rank,
            model_data=types.ModelData(arch=getattr(self.base.config, "model_type", None), model_name=self.name,
                                       tokenizer_id=self.tokenizer_dir)))

    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.name:
            raise ValueError(f"base_model {base_model!r}: this server serves {self.name!r} only")

    def _check_session(self, session_id: str) -> None:
        if self.sessions.get(session_id) is not False:
            raise ValueError(f"session {session_id!r} is not open on this server")

    # training calls (on the worker)

    def admitted(self, request: Any) -> Any:
        """``request`` (an SDK request type) when it is within the limits and names what the store
        may hold (``OverLimit``, ``BadPath``: answered 400 before it is queued)."""
        if isinstance(request, types.CreateModelRequest) and request.lora_config is not None:
            self.limits.check_rank("lora_config.rank", request.lora_config.rank)
        elif isinstance(request, wire.ForwardBackward):
            for i, datum in enumerate(request.data):
                self.limits.check_tokens(f"datum {i}'s model_input length", len(datum.tokens))
            self.limits.check_batch(sum(len(datum.tokens) for datum in request.data))
        elif isinstance(request, (types.SaveWeightsRequest, types.SaveWeightsForSamplerRequest)):
            if request.path is not None:
                check_name(request.path, "path")
        elif isinstance(request, types.LoadWeightsRequest):
            parse_path(request.path, "path")
        elif isinstance(request, types.CreateSamplingSessionRequest) and request.model_path is not None:
            parse_path(request.model_path, "model_path")
        return request

    def _saved_lora(self, path: str, saved: dict[str, Any]) -> LoraSettings | None:
        """The LoRA settings a checkpoint's metadata ``saved`` records (its rank within the limit)."""
        lora = saved.get("lora")
        if lora is None:
            return None
        self.limits.check_rank(f"{path}: the saved LoRA rank", int(lora["rank"]))
        return LoraSettings(**lora)

    def _lora(self, config: types.LoraConfig | None) -> LoraSettings | None:
        if config is None:
            return None
        self.limits.check_rank("lora_config.rank", config.rank)
        return LoraSettings(config.rank, self.lora_alpha, config.seed or 0, config.train_attn, config.train_mlp,
                            config.train_unembed)

    def _add_model(self, model_id: str, session_id: str, lora: LoraSettings | None,
                   user_metadata: dict[str, Any] | None) -> TrainingModel:
        if model_id in self.models:
            raise ValueError(f"model {model_id!r} exists already")
        trainable, params = make_trainable(self.base, self.base_params, lora)
        metadata = None if user_metadata is None else {str(k): str(v) for k, v in user_metadata.items()}
        model = TrainingModel(model_id, session_id, trainable, new_state(params), metadata)
        self.models[model_id] = model
        return model

    def create_model(self, request: types.CreateModelRequest) -> dict[str, Any]:
        self._check_session(request.session_id)
        self._check_base(request.base_model)
        if getattr(request.optimizer_config, "type", "adamw") != "adamw":
            raise ValueError(f"optimizer {request.optimizer_config.type!r} is not served (AdamW only)")
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        self._add_model(model_id, request.session_id, self._lora(request.lora_config), request.user_metadata)
        return wire.json_answer(types.CreateModelResponse(type="create_model", model_id=model_id))

    def forward_backward(self, request: wire.ForwardBackward) -> bytes:
        model = self.model(request.model_id)
        loss = loss_of(request.loss_fn)
        config = bound_config(loss, request.config)
        batch = batch_of(request.data, self.vocab, self.context, self.device)
        state, logp, total = forward_backward(model.trainable, model.state, batch, loss, config,
                                              backward=not request.forward_only)
        model.state = state
        logprobs = [logp[i, :n].detach().float().cpu().numpy() for i, n in enumerate(batch.lengths)]
        return wire.forward_backward_output(logprobs, float(total))

    def optim_step(self, request: types.OptimStepRequest) -> dict[str, Any]:
        model = self.model(request.model_id)
        adam = request.optim_params
        if not isinstance(adam, types.AdamParams):
            raise ValueError(f"optimizer parameters of type {getattr(adam, 'type', '?')!r} are not served (Adam only)")
        model.state, metrics = optim_step(model.state, learning_rate=adam.learning_rate, beta1=adam.beta1,
                                          beta2=adam.beta2, eps=adam.eps, weight_decay=adam.weight_decay,
                                          grad_clip_norm=adam.grad_clip_norm)
        return wire.json_answer(types.OptimStepResponse(metrics=metrics))

    def _metadata(self, model: TrainingModel, optimizer: bool, user_metadata: dict[str, str] | None) -> dict[str, Any]:
        lora = model.trainable.lora
        return {"base_model": self.name, "lora": None if lora is None else lora.as_dict(), "optimizer": optimizer,
                "steps": model.state.steps, "run_metadata": model.user_metadata, "user_metadata": user_metadata}

    def _snapshot(self, model: TrainingModel, path: str | None) -> Snapshot:
        snapshot = Snapshot.of(next(self._numbers), model.trainable, model.state.params, path)
        self.snapshots[snapshot.number] = snapshot
        if path is not None:
            self.by_path[path] = snapshot.number
        return snapshot

    def save_weights_for_sampler(self, request: types.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        model = self.model(request.model_id)
        if request.kind != "snapshot":
            raise ValueError(f"sampler kind {request.kind!r} is not served (snapshot only)")
        if request.path is None:
            if request.sampling_session_seq_id is None:
                raise ValueError("save_weights_for_sampler needs a path or a sampling_session_seq_id")
            sampler_id = f"{model.session_id}:sample:{request.sampling_session_seq_id}"
            self.samplers[sampler_id] = self._snapshot(model, None).number
            return wire.json_answer(types.SaveWeightsForSamplerResponseInternal(type="save_weights_for_sampler",
                                                                                sampling_session_id=sampler_id))
        path = tinker_path(model.model_id, "sampler_weights", request.path)
        self.store.save(path, {"params": model.state.params}, step=model.state.steps,
                        metadata=self._metadata(model, False, request.user_metadata))
        self._snapshot(model, path)
        return wire.json_answer(types.SaveWeightsForSamplerResponse(type="save_weights_for_sampler", path=path))

    def save_weights(self, request: types.SaveWeightsRequest) -> dict[str, Any]:
        model = self.model(request.model_id)
        path = tinker_path(model.model_id, "weights", request.path or f"step-{model.state.steps:06d}")
        self.store.save(path, {"params": model.state.params, "opt": model.state.opt}, step=model.state.steps,
                        metadata=self._metadata(model, True, request.user_metadata), overwrite=request.overwrite)
        return wire.json_answer(types.SaveWeightsResponse(type="save_weights", path=path))

    def _restored(self, path: str, state: ModelState, optimizer: bool) -> ModelState:
        """``state`` with the params (and, with ``optimizer``, the AdamW state) saved under ``path``."""
        saved = self.store.metadata(path)
        self._check_base(saved.get("base_model"))
        if optimizer and not saved.get("optimizer"):
            raise ValueError(f"{path} holds no optimizer state (sampler weights); load it with optimizer=False")
        template = {"params": state.params, **({"opt": state.opt} if saved.get("optimizer") else {})}
        loaded = self.store.load(path, template)
        restored = new_state(loaded["params"])
        return ModelState(loaded["params"], loaded["opt"] if optimizer else restored.opt, None,
                          int(saved.get("steps", 0)) if optimizer else 0)

    def load_weights(self, request: types.LoadWeightsRequest) -> dict[str, Any]:
        if request.optimizer_config is not None and getattr(request.optimizer_config, "type", "adamw") != "adamw":
            raise ValueError("optimizer_config: AdamW only")
        if request.model_id is not None:  # into an existing model, in its call order
            model = self.model(request.model_id)
            model.state = self._restored(request.path, model.state, request.optimizer)
            return wire.json_answer(types.LoadWeightsResponse(type="load_weights", path=request.path,
                                                              model_id=model.model_id))
        if request.session_id is None or request.model_seq_id is None:
            raise ValueError("load_weights needs model_id, or session_id and model_seq_id")
        self._check_session(request.session_id)
        self._check_base(request.base_model)
        saved = self.store.metadata(request.path)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        model = self._add_model(model_id, request.session_id, self._saved_lora(request.path, saved),
                                request.user_metadata)
        try:
            model.state = self._restored(request.path, model.state, request.optimizer)
        except Exception:
            del self.models[model_id]
            raise
        return wire.json_answer(types.LoadWeightsResponse(type="load_weights", path=request.path, model_id=model_id))

    # training runs and their checkpoints (on the worker: after the saves queued before them)

    def training_run(self, run_id: str) -> dict[str, Any]:
        """``GET training_runs/{id}`` (:mod:`.runs`; ``KeyError``: unknown)."""
        check_model_id(run_id, "training run id")
        model = self.models.get(run_id)
        live = None if model is None else {
            "base_model": self.name, "lora": None if model.trainable.lora is None else model.trainable.lora.as_dict(),
            "user_metadata": model.user_metadata, "last_request_time": model.last_request}
        return runs.training_run(self.store, run_id, live).model_dump(mode="json")

    def checkpoints(self, run_id: str) -> dict[str, Any]:
        """``GET training_runs/{id}/checkpoints`` (``KeyError``: unknown)."""
        check_model_id(run_id, "training run id")
        return runs.checkpoint_list(self.store, run_id, run_id in self.models).model_dump(mode="json")

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        """``DELETE training_runs/{id}/checkpoints/{kind}/{name}`` (``KeyError``: nothing there)."""
        check_model_id(run_id, "training run id")
        path = f"tinker://{run_id}/{checkpoint_id}"
        parse_path(path, "checkpoint_id")
        if not self.store.exists(path):
            raise KeyError(path)
        self.store.delete(path)
        number = self.by_path.pop(path, None)
        if number is not None and number not in self.samplers.values():
            self.snapshots.pop(number, None)

    def weights_info(self, path: str) -> dict[str, Any]:
        """``POST weights_info``: what loading the checkpoint ``path`` builds (``KeyError``: nothing there)."""
        parse_path(path, "tinker_path")
        if not self.store.exists(path):
            raise KeyError(path)
        return runs.weights_info(self.store, path).model_dump(mode="json")

    # sampling

    def sampler_snapshot(self, model_path: str | None, base_model: str | None) -> int:
        """The snapshot a sampling client of ``model_path`` (or the base) samples, loaded from disk
        when this server did not save it (on the worker)."""
        if model_path is None:
            self._check_base(base_model or self.name)
            return 0
        if model_path in self.by_path:
            return self.by_path[model_path]
        parse_path(model_path, "model_path")
        saved = self.store.metadata(model_path)
        self._check_base(saved.get("base_model"))
        trainable, params = make_trainable(self.base, self.base_params, self._saved_lora(model_path, saved))
        template = {"params": params, **({"opt": new_state(params).opt} if saved.get("optimizer") else {})}
        loaded = self.store.load(model_path, template)
        number = next(self._numbers)
        self.snapshots[number] = Snapshot(number, trainable, loaded["params"], model_path)
        self.by_path[model_path] = number
        return number

    def create_sampling_session(self, request: types.CreateSamplingSessionRequest) -> str:
        self._check_session(request.session_id)
        sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        self.samplers[sampler_id] = self.sampler_snapshot(request.model_path, request.base_model)
        return sampler_id

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        if sampler_id not in self.samplers:
            raise KeyError(sampler_id)
        return wire.json_answer(types.GetSamplerResponse(sampler_id=sampler_id, base_model=self.name,
                                                         model_path=self.snapshots[self.samplers[sampler_id]].path))

    def sample_work(self, request: types.SampleRequest, settings: SamplingRequest) -> Batched:
        """The work of an ``asample`` request (its snapshot resolved now, its settings checked there),
        as a batch member: requests with the same ``key`` waiting together share engine calls. A
        request with its own ``seed`` is sampled alone, so that its draw does not depend on others.
        ``OverLimit`` for a request past the limits."""
        if request.sampling_session_id is not None:
            if request.sampling_session_id not in self.samplers:
                raise ValueError(f"sampling session {request.sampling_session_id!r} is not open on this server")
            source: Hashable = self.samplers[request.sampling_session_id]
        else:
            source = (request.model_path, request.base_model)
        prompt = wire.prompt_tokens(request.prompt, "prompt")
        self.limits.check_samples(request.num_samples)
        self.limits.check_tokens("prompt length", len(prompt))
        if settings.max_tokens is not None:
            self.limits.check_tokens("sampling_params.max_tokens", settings.max_tokens)
        if request.model_path is not None:
            parse_path(request.model_path, "model_path")
        alone = object() if settings.seed is not None else None

        def run(prompts: list[list[int]]) -> list[bytes | ValueError]:
            number = source if isinstance(source, int) else self.sampler_snapshot(*source)
            sampled = self.sampler.sample_many(self.snapshots[number], prompts, request.num_samples, settings)
            return [s if isinstance(s, ValueError) else wire.sample_response(s) for s in sampled]

        return Batched(("sample", source, settings, request.num_samples, alone), prompt, run)
