"""A Tinker training client's model as purerl values: a LoRA (or full) policy over one frozen base,
its params tree, AdamW state and accumulated gradients, and the pure steps the server runs on them.

``forward_backward`` adds the gradient of a loss's token sum (:mod:`purerl.tinker.losses`) to the
accumulated gradients (Tinker accumulates until ``optim_step``); ``optim_step`` applies them with
``purerl.optim.adamw`` built from the request's Adam settings (AdamW's state, the moments and the
count, does not depend on them), after ``clip_by_global_norm`` when ``grad_clip_norm > 0``, and
clears them. A datum's ``model_input`` ``x_0 … x_{N−1}`` and ``target_tokens`` ``y_0 … y_{N−1}``
(``x_i`` predicts ``y_i``) run as the row ``x_0 … x_{N−1} y_{N−1}`` whose logits at positions
``0 … N−1`` are taken at the targets, so targets need not be the shifted inputs.

LoRA (``LoraSettings``): adapters on attention (``q,k,v,o_proj``) and MLP (``gate,up,down_proj``)
layers as :mod:`purerl.models.lora` makes them, scale ``alpha / rank``; ``train_unembed`` adds one
on the output projection: ``W_out + s·B·A`` with ``W_out`` the ``lm_head`` weight, which for tied
embeddings is the embedding matrix, whose input side stays frozen (the adapter unties the output
layer only). Its params are ``lm_head.lora_A.weight`` / ``lm_head.lora_B.weight``; ``B`` starts at
zero, so a new model computes its base exactly.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch import Tensor

from purerl.algo.aggregation import SumCount
from purerl.batch import Sequences
from purerl.models import CausalLM, Params, value_and_grad
from purerl.models.lora import LoraSpec, apply_lora
from purerl.models.scores import response_scores
from purerl.optim import AdamWState, adamw, clip_by_global_norm
from purerl.tinker.losses import TinkerLoss
from purerl.tree import tree_clone, tree_map

__all__ = ["ATTENTION", "MLP", "Datum", "LoraSettings", "ModelState", "Trainable", "TrainBatch", "batch_of",
           "forward_backward", "make_trainable", "new_state", "optim_step", "policy_params", "sampler_params"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_HEAD_A, _HEAD_B = "lm_head.lora_A.weight", "lm_head.lora_B.weight"


@attrs.frozen
class LoraSettings:
    """What ``create_model``'s ``lora_config`` asked for, with the server's ``alpha``."""

    rank: int
    alpha: float
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(eq=False)
class Trainable:
    """The resource a training model computes with: ``model`` (the LoRA-wrapped base, or the base
    with its weights in ``frozen`` when only the output layer is adapted, or the base itself for
    full fine-tuning), ``head`` the output weight's canonical name and ``head_scale`` the scale of
    its adapter (None: no adapter), and the ``lora`` settings (None: full fine-tuning)."""

    model: CausalLM
    lora: LoraSettings | None
    head: str = "lm_head.weight"
    head_scale: float | None = None


@attrs.frozen(eq=False)
class ModelState:
    """A training model's values: ``params`` (the trained leaves), ``opt`` (AdamW's), ``grads``
    accumulated since the last ``optim_step`` (None: none yet) and ``steps`` (optimizer steps)."""

    params: Params
    opt: AdamWState
    grads: Params | None = None
    steps: int = 0


@attrs.frozen
class Datum:
    """One Tinker datum: its input tokens and its ``loss_fn_inputs`` as 1-d arrays (targets included)."""

    tokens: Sequence[int]
    inputs: Mapping[str, np.ndarray]


@attrs.frozen(eq=False)
class TrainBatch:
    """Datums as one padded batch: ``sequences`` (rows ``x … y_{N−1}``, responses from column 1),
    ``targets`` ``[b, n]``, ``mask`` ``[b, n]`` (a datum's positions) and its float ``inputs``."""

    sequences: Sequences
    targets: Tensor
    mask: Tensor
    inputs: dict[str, Tensor]
    lengths: list[int]


def make_trainable(base: CausalLM, base_params: Params, lora: LoraSettings | None) -> tuple[Trainable, Params]:
    """The resource and initial params of a new training model over ``base`` (``ValueError`` in one
    line when the settings cannot be honoured exactly)."""
    if lora is None:
        return Trainable(base, None), tree_clone(base_params)
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise ValueError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
    targets = (ATTENTION if lora.train_attn else ()) + (MLP if lora.train_mlp else ())
    spec = LoraSpec(lora.rank, lora.alpha, targets)
    if targets:
        model, params = apply_lora(base, base_params, spec, seed=lora.seed)
    else:
        model, params = attrs.evolve(base, frozen=dict(base_params)), {}
    if not lora.train_unembed:
        return Trainable(model, lora), params
    head = base.aliases.get("lm_head.weight", "lm_head.weight")
    if head not in base_params:
        raise ValueError("lora_config.train_unembed: this model has no lm_head weight to adapt")
    if head != "lm_head.weight" and not model.lean:
        raise ValueError("lora_config.train_unembed: a tied output layer can be adapted only through a lean model "
                         "family (Llama, Qwen2, Qwen3, Gemma 3); pass train_unembed=False for this model")
    weight = base_params[head]
    generator = torch.Generator().manual_seed(lora.seed + 1)
    bound = 1.0 / math.sqrt(weight.shape[1])  # nn.Linear's and PEFT's init of lora_A
    a = torch.rand(lora.rank, weight.shape[1], generator=generator, dtype=torch.float64) * (2 * bound) - bound
    params = {**params, _HEAD_A: a.to(weight), _HEAD_B: weight.new_zeros(weight.shape[0], lora.rank)}
    return Trainable(model, lora, head, spec.scale), params


def policy_params(trainable: Trainable, params: Params) -> Params:
    """What the model computes with: the layer adapters (or weights) and, with an output adapter,
    ``lm_head.weight = W_out + s·B·A`` (differentiable in ``A`` and ``B``)."""
    if trainable.head_scale is None:
        return params
    rest = {k: v for k, v in params.items() if k not in (_HEAD_A, _HEAD_B)}
    base = trainable.model.frozen[trainable.head]
    rest["lm_head.weight"] = base + trainable.head_scale * (params[_HEAD_B] @ params[_HEAD_A]).to(base.dtype)
    return rest


def sampler_params(trainable: Trainable, params: Params) -> Params:
    """A plain params tree of the base model computing what ``params`` compute (adapters folded
    in; new tensors where they change a weight): what the sampling engine decodes with."""
    model = trainable.model
    return model.merged(model.full(policy_params(trainable, params)))


def batch_of(datums: Sequence[Datum], vocab: int, context: int, device: torch.device) -> TrainBatch:
    """The padded batch of ``datums`` (``ValueError`` in one line for an empty input, a token outside
    the vocabulary, inputs whose length is not the input's, or a row past the ``context``)."""
    if not datums:
        raise ValueError("forward_backward: no data")
    lengths = [len(d.tokens) for d in datums]
    n = max(lengths)
    names = sorted({k for d in datums for k in d.inputs if k != "target_tokens"})
    ids = torch.zeros(len(datums), n + 1, dtype=torch.long)
    targets = torch.zeros(len(datums), n, dtype=torch.long)
    mask = torch.zeros(len(datums), n, dtype=torch.bool)
    inputs = {k: torch.zeros(len(datums), n, dtype=torch.float32) for k in names}
    for i, d in enumerate(datums):
        k = lengths[i]
        if k == 0 or k + 1 > context:
            raise ValueError(f"datum {i}: model_input has {k} tokens; 1 to {context - 1} are served")
        target = d.inputs.get("target_tokens")
        if target is None:
            raise ValueError(f"datum {i}: loss_fn_inputs needs target_tokens")
        for name, value in d.inputs.items():
            if value.ndim != 1 or len(value) != k:
                raise ValueError(f"datum {i}: loss_fn_inputs {name} has shape {list(value.shape)}, expected [{k}] "
                                 "(one value per input token)")
        row = np.concatenate([np.asarray(d.tokens, dtype=np.int64), target[-1:].astype(np.int64)])
        if row.min() < 0 or row.max() >= vocab or target.min() < 0 or target.max() >= vocab:
            raise ValueError(f"datum {i}: a token id is outside the vocabulary [0, {vocab})")
        ids[i, : k + 1] = torch.from_numpy(row)
        targets[i, :k] = torch.from_numpy(target.astype(np.int64))
        mask[i, :k] = True
        for name in names:
            if name in d.inputs:
                inputs[name][i, :k] = torch.from_numpy(d.inputs[name].astype(np.float32))
    attention = torch.cat([mask[:, :1], mask], 1)
    sequences = Sequences(ids.to(device), attention.to(device), mask.to(device))
    return TrainBatch(sequences, targets.to(device), mask.to(device), {k: v.to(device) for k, v in inputs.items()},
                      lengths)


def _target_logprobs(trainable: Trainable, params: Params, batch: TrainBatch) -> Tensor:
    return response_scores(trainable.model, policy_params(trainable, params), batch.sequences,
                           ids=batch.targets[..., None]).logprobs[..., 0]


def forward_backward(trainable: Trainable, state: ModelState, batch: TrainBatch, loss: TinkerLoss,
                     config: Mapping[str, float], *, backward: bool) -> tuple[ModelState, Tensor, Tensor]:
    """``(state', logprobs [b, n], loss total)``: the learner's log-probs of the targets and the
    loss's token sum; with ``backward`` its gradient is added to ``state.grads`` (the accumulated
    gradient of the sum of the totals)."""
    missing = [k for k in loss.inputs if k not in batch.inputs]
    extra = sorted(set(batch.inputs) - set(loss.inputs) - set(loss.optional))
    if missing or extra:
        name = missing[0] if missing else extra[0]
        raise ValueError(f"loss {loss.name!r} {'needs' if missing else 'takes no'} loss_fn_inputs {name!r} "
                         f"(it takes target_tokens, {', '.join(loss.inputs + loss.optional)})")

    def loss_fn(params: Params) -> tuple[SumCount, Tensor]:
        logp = _target_logprobs(trainable, params, batch)
        return loss.fn(logp, batch.inputs, batch.mask, config), logp

    if not backward:
        with torch.no_grad():
            total, logp = loss_fn(state.params)
        return state, logp, total.total
    total, logp, grads = value_and_grad(loss_fn)(state.params, denominator=1.0)
    if state.grads is not None:
        grads = tree_map(torch.add, state.grads, grads)
    return attrs.evolve(state, grads=grads), logp, total.total


def optim_step(state: ModelState, *, learning_rate: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, grad_clip_norm: float) -> tuple[ModelState, dict[str, float]]:
    """Apply the accumulated gradients (zeros when none) with AdamW (donating ``state``'s params and
    moments) and clear them; metrics: the gradient norm before clipping when clipping."""
    grads = state.grads if state.grads is not None else tree_map(torch.zeros_like, state.params)
    metrics: dict[str, float] = {}
    if grad_clip_norm > 0:
        clip = clip_by_global_norm(grad_clip_norm)
        grads, clipped = clip.update(grads, clip.init(grads))
        metrics["grad_norm:mean"] = float(clipped.last_norm)
    optimizer = adamw(learning_rate, beta1, beta2, eps, weight_decay)
    params, opt = optimizer.update(grads, state.opt, state.params)
    return ModelState(params, opt, None, state.steps + 1), metrics


def new_state(params: Params) -> ModelState:
    """A fresh model's values: AdamW's zero moments (its hyperparameters come with each step)."""
    return ModelState(params, adamw(0.0).init(params))
