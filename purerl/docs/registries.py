"""Every entry of purerl's named registries, as the registries reference shows it: its names, its
documentation, and the settings it reads (``section.key`` of the job's config).

An entry's documentation is its function's docstring; a registered record (an estimator, a loss, a
model family, a kind of environment) is documented by the function it wraps, a kind of rollout
engine by its description and what it can do. An estimator whose wrapper has none is documented by
the function its body calls (``_grpo`` → ``grpo_advantages``).
What a policy loss reads is what its declared ``reads`` returns (keyword settings named like the
fields of :class:`~purerl.algo.loss_settings.PolicyLossSettings` they come from); what an estimator
reads, the attributes of its settings argument in its source.
"""

import ast
import inspect
import sys
import textwrap
import typing
from collections.abc import Callable
from typing import Any

import attrs

from purerl.algo.aggregation import LOSS_AGGREGATIONS, Aggregation
from purerl.algo.correction import IS_CORRECTIONS
from purerl.algo.estimators import ADVANTAGE_ESTIMATORS, AdvantageSettings, Estimator
from purerl.algo.kl import KL_ESTIMATORS
from purerl.algo.kl_control import KL_CONTROLLERS
from purerl.algo.loss_records import PolicyLoss
from purerl.algo.loss_settings import PolicyLossSettings
from purerl.algo.policy_loss import POLICY_LOSSES
from purerl.config.job import JobConfig
from purerl.config.loading import keys_of
from purerl.environments import ENVIRONMENTS, EnvironmentKind
from purerl.executor_kinds import EXECUTORS, ExecutorKind
from purerl.models.families import FAMILIES, Family
from purerl.optim.base import GRADIENT_TRANSFORMS, OPTIMIZERS
from purerl.optim.schedules import SCHEDULES
from purerl.registry import Registry
from purerl.rollout.engines import ENGINES, EngineKind

__all__ = ["DOCUMENTED", "Entry", "Listing", "entries", "entry_doc", "entry_reads"]


@attrs.frozen
class Listing:
    """A registry on the site: its title, what it holds, and the settings that select one of its
    entries by name."""

    title: str
    registry: Registry
    summary: str
    selected_by: tuple[str, ...] = ()


DOCUMENTED = (
    Listing("Advantage estimators", ADVANTAGE_ESTIMATORS, "How a step turns rewards into advantages (and returns).",
            ("algorithm.adv_estimator",)),
    Listing("Policy losses", POLICY_LOSSES, "What the actor's update minimises, per token.", ("actor.policy_loss",)),
    Listing("KL estimators", KL_ESTIMATORS, "Per-token estimates of the KL to the reference, from "
            "``(logp, ref_logp)`` (:func:`~purerl.algo.kl.kl_estimate` also takes a name with a ``+``, ``k3+``: the "
            "value of that estimator with the gradient of ``k2``).",
            ("algorithm.kl_penalty", "actor.kl_loss_type")),
    Listing("KL controllers", KL_CONTROLLERS, "The coefficient of the KL penalty in the reward.",
            ("algorithm.kl_ctrl.type",)),
    Listing("Loss aggregations", LOSS_AGGREGATIONS, "How per-token losses become one number, as a ``(sum, count)`` "
            "pair that micro-batches and ranks add exactly.", ("actor.loss_agg",)),
    Listing("Off-policy corrections", IS_CORRECTIONS, "Importance weights from the engine's log-probs to the "
            "trainer's.", ("algorithm.rollout_correction",)),
    Listing("Rollout engines", ENGINES, "What samples the responses: each kind says what it can do and what it "
            "needs installed.", ("rollout.engine",)),
    Listing("Executors", EXECUTORS, "What runs a job's steps: each kind says what it can do.", ("executor.kind",)),
    Listing("Environments", ENVIRONMENTS, "Kinds of environment: the built-ins by name, the others recognised in "
            "what a ``module:name`` names.", ("env.name",)),
    Listing("Model families", FAMILIES, "Architectures with a lean forward (the others run their HF module)."),
    Listing("Optimizers", OPTIMIZERS, "Optimizer factories for scripts that build their own step."),
    Listing("Gradient transforms", GRADIENT_TRANSFORMS, "Gradient transforms to chain before an optimizer."),
    Listing("Learning-rate schedules", SCHEDULES, "Schedules an optimizer's learning rate may follow."),
)
"""The registries the site documents, in the order of the page."""


@attrs.frozen
class Entry:
    """One registered entry: its names (the first is the one it was registered under), its
    documentation, the function that carries it, and the ``section.key`` settings it reads."""

    names: tuple[str, ...]
    doc: str
    source: Callable[..., Any] | None
    reads: tuple[str, ...]


def entries(listing: Listing) -> list[Entry]:
    """The entries of ``listing``'s registry in the order of registration."""
    return [Entry(names, entry_doc(entry), _source(entry), entry_reads(entry))
            for names, entry in listing.registry.entries()]


def _source(entry: Any) -> Callable[..., Any] | None:
    """The function that documents ``entry``."""
    if isinstance(entry, Estimator):
        return entry.fn if inspect.getdoc(entry.fn) else _called(entry.fn)
    if isinstance(entry, PolicyLoss):
        return entry.fn
    if isinstance(entry, EnvironmentKind):
        return entry.make
    if isinstance(entry, Family):
        return entry.supports
    if isinstance(entry, Aggregation):
        return entry.fn
    return entry if callable(entry) else None


def entry_doc(entry: Any) -> str:
    """``entry``'s documentation ("" when it has none)."""
    if isinstance(entry, Family) and entry.description:
        return entry.description
    if isinstance(entry, Family):  # documented by the module that implements it
        return (sys.modules[entry.supports.__module__].__doc__ or "").split("\n\n")[0].strip()
    if isinstance(entry, EnvironmentKind) and entry.description:
        return entry.description[0].upper() + entry.description[1:] + "."
    if isinstance(entry, EngineKind):
        return _engine_doc(entry)
    if isinstance(entry, ExecutorKind):
        return _executor_doc(entry)
    source = _source(entry)
    return (inspect.getdoc(source) if source is not None else None) or ""


def _engine_doc(kind: EngineKind) -> str:
    """A kind of engine's description, then what it can do and what it needs."""
    can = [fact for fact, holds in (
        ("rows stop and continue on newer weights (``asynchronous.interruptible``)", kind.interruptible),
        ("its float32 log-probs are the trainer's (a synchronous step need not recompute them)", kind.exact_logprobs),
        ("it may run inside the training ranks (Ray's colocated placements)", kind.colocates)) if holds]
    lines = [kind.description + "." if kind.description else ""]
    if can:
        lines.append("; ".join(can)[0].upper() + "; ".join(can)[1:] + ".")
    lines.append(f"Weight-sync canary tolerance in float32: {kind.sync_tolerance:g} nats per token.")
    if kind.requires:
        lines.append(kind.install_hint[0].upper() + kind.install_hint[1:] + ".")
    return " ".join(line for line in lines if line)


def _executor_doc(kind: ExecutorKind) -> str:
    """A kind of executor's description, then what it can do."""
    can = [fact for fact, holds in (
        ("the driver computes on ``model.device``", kind.computes_on_driver),
        ("roles live on resource pools (``executor.placement``)", kind.placements),
        ("updates shard over ``executor.train_ranks`` ranks", kind.shards_updates),
        ("parameters and optimizer state can wait in host memory (``actor.offload_params``)", kind.offloads))
           if holds]
    text = kind.description[0].upper() + kind.description[1:] + "." if kind.description else ""
    return " ".join(part for part in (text, "; ".join(can)[:1].upper() + "; ".join(can)[1:] + "." if can else "")
                    if part)


def entry_reads(entry: Any) -> tuple[str, ...]:
    """The ``section.key`` settings ``entry`` reads: a loss's declared ``reads`` (its keyword
    settings, named like the fields they come from), the settings an estimator's function touches;
    () for the others."""
    if isinstance(entry, PolicyLoss):
        return tuple(_key_of(PolicyLossSettings, name) for name in entry.reads(PolicyLossSettings()))
    if isinstance(entry, Estimator):
        return tuple(_key_of(AdvantageSettings, name) for name in _settings_attributes(entry.fn))
    return ()


def _key_of(record: type, name: str) -> str:
    """The key of the setting ``name`` in the section that is a ``record``, nested records searched
    (``tau_pos`` → ``actor.loss_options.tau_pos``)."""
    section = _section_of(record)
    return next(key for key in keys_of(JobConfig) if key.startswith(f"{section}.") and key.endswith(f".{name}"))


def _section_of(record: type) -> str:
    """The section of the job's config that *is* a ``record`` (``actor`` for the loss settings)."""
    hints = typing.get_type_hints(JobConfig)
    return next(f.name for f in attrs.fields(JobConfig) if issubclass(hints[f.name], record))


def _function_node(fn: Callable[..., Any]) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def _settings_attributes(fn: Callable[..., Any]) -> list[str]:
    """The attributes ``fn(inputs, settings)`` reads from its ``settings`` argument, in order."""
    node = _function_node(fn)
    settings = node.args.args[1].arg
    found = [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == settings]
    return list(dict.fromkeys(found))


def _called(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The function that ``fn``'s body calls first by name (what a one-line wrapper wraps)."""
    for call in (n for statement in _function_node(fn).body for n in ast.walk(statement)):  # decorators aside
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            return inspect.unwrap(fn).__globals__.get(call.func.id)  # a type checker's wrapper has its own
    return None
