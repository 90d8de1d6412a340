"""Training runs and their checkpoints as the SDK's ``RestClient`` reads them: what resuming needs.

A training run is a training model (its id, ``<session>:train:<n>``), live on this server or known
only from the checkpoints it left in the store (a restarted server, or a finished session): the
cookbook reads ``GET training_runs/{id}`` for the run's ``user_metadata`` (the renderer it trained
with) before it resumes from ``tinker://<id>/weights/<name>`` through ``load_weights``. The answers
are the SDK's own types (``types.TrainingRun``, ``types.Checkpoint``,
``types.CheckpointsListResponse``, ``types.WeightsInfoResponse``), built here from

- a live model: its LoRA settings, ``user_metadata`` and last call's time;
- else its newest checkpoint's manifest metadata (base model, LoRA settings, ``run_metadata``: the
  ``user_metadata`` the run was created with), its time that checkpoint's.

A checkpoint's ``time`` is its folder's modification time (UTC), ``size_bytes`` its files' sizes,
``checkpoint_id`` ``<weights|sampler_weights>/<name>`` (the SDK's parsing of a ``tinker://`` path);
checkpoints never expire (``ttl_seconds`` is accepted and not enforced: they stay until deleted).
An unknown run or checkpoint raises ``KeyError`` (answered 404).
"""

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker import types

from purerl.io.checkpoint import read_manifest
from purerl.tinker.store import Store, parse_path

__all__ = ["OWNER", "checkpoint_list", "checkpoint_of", "training_run", "weights_info"]

OWNER = "local"  # the model_owner of every run: one user per loopback server

_TYPES = {"weights": "training", "sampler_weights": "sampler"}


def _when(folder: Path) -> datetime:
    return datetime.fromtimestamp(folder.stat().st_mtime, UTC)


def checkpoint_of(path: str, folder: Path) -> types.Checkpoint:
    """The SDK's description of the checkpoint ``path`` saved in ``folder``."""
    _, kind, name = parse_path(path)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    metadata = read_manifest(folder)["metadata"].get("user_metadata")
    return types.Checkpoint(checkpoint_id=f"{kind}/{name}", checkpoint_type=_TYPES[kind], time=_when(folder),
                            tinker_path=path, size_bytes=size, user_metadata=metadata)


def checkpoint_list(store: Store, run_id: str, live: bool) -> types.CheckpointsListResponse:
    """Every checkpoint of ``run_id``, oldest first (``KeyError``: neither ``live`` nor saved)."""
    saved = store.saved(run_id)
    if not saved and not live:
        raise KeyError(run_id)
    return types.CheckpointsListResponse(checkpoints=[checkpoint_of(p, f) for p, f in saved])


def training_run(store: Store, run_id: str, live: dict[str, Any] | None) -> types.TrainingRun:
    """The run ``run_id``: ``live`` is its model's ``base_model``, ``lora`` (settings dict or None),
    ``user_metadata`` and ``last_request_time`` when it is loaded; else its newest checkpoint tells
    (``KeyError`` when neither)."""
    saved = store.saved(run_id)
    newest = {kind: None for kind in _TYPES.values()}
    for path, folder in saved:
        newest[_TYPES[parse_path(path)[1]]] = (path, folder)
    if live is None:
        if not saved:
            raise KeyError(run_id)
        path, folder = saved[-1]
        metadata = read_manifest(folder)["metadata"]
        live = {"base_model": metadata.get("base_model"), "lora": metadata.get("lora"),
                "user_metadata": metadata.get("run_metadata"), "last_request_time": _when(folder)}
    lora = live["lora"]
    return types.TrainingRun(
        training_run_id=run_id, base_model=str(live["base_model"]), model_owner=OWNER, is_lora=lora is not None,
        lora_rank=None if lora is None else int(lora["rank"]), last_request_time=live["last_request_time"],
        last_checkpoint=None if newest["training"] is None else checkpoint_of(*newest["training"]),
        last_sampler_checkpoint=None if newest["sampler"] is None else checkpoint_of(*newest["sampler"]),
        user_metadata=live["user_metadata"])


def weights_info(store: Store, path: str) -> types.WeightsInfoResponse:
    """What loading the checkpoint ``path`` builds: its base model and LoRA settings (``ValueError``
    when nothing is saved there)."""
    metadata = store.metadata(path)
    lora = metadata.get("lora")
    if lora is None:
        return types.WeightsInfoResponse(base_model=str(metadata.get("base_model")), is_lora=False)
    return types.WeightsInfoResponse(base_model=str(metadata.get("base_model")), is_lora=True,
                                     lora_rank=int(lora["rank"]), train_unembed=bool(lora["train_unembed"]),
                                     train_mlp=bool(lora["train_mlp"]), train_attn=bool(lora["train_attn"]))
