"""The critic, the reference and a distillation teacher as roles on a pool of their own
(:mod:`purerl.step.roles`), as the training ranks see them.

The step function runs on every training rank; it asks these roles for the critic's values and
update, for the reference log-probs and for the teacher's scores. Rank 0 calls every rank of the role's pool (they split
the rows and answer through their rank 0) and broadcasts the answer to the other training ranks,
so the pool does each stage once per step whatever the number of training ranks. The params the
step passes in are ``None``: the pool holds them (and the critic's optimizer state). The critic's
update runs on its pool while the step goes on: its metrics are waited for when first read
(:func:`~purerl.step.ppo_step` reads them after the actor's update, so the two updates overlap).
A pool rank that fails fails every training rank's step with one :class:`ExecutorError` naming
it, which the driver reports as the run's error.
"""

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from purerl.executors.base import ExecutorError
from purerl.executors.wire import from_wire, to_wire
from purerl.state import RngState
from purerl.tree import tree_map

__all__ = ["RemoteCritic", "RemoteReference", "RemoteTeacher"]


class _Answer(Mapping[str, float]):
    """Metrics a pool is still computing: the first read waits for them."""

    def __init__(self, wait: Callable[[], dict[str, float]]) -> None:
        self._wait, self._metrics = wait, None

    def _got(self) -> dict[str, float]:
        if self._metrics is None:
            self._metrics = self._wait()
        return self._metrics

    def __getitem__(self, key: str) -> float:
        return self._got()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._got())

    def __len__(self) -> int:
        return len(self._got())


class _RemoteRole:
    pool = ""

    def __init__(self, ranks: list[Any], rank: int, device: str, timeout_s: float) -> None:
        self.ranks, self.rank, self.device, self.timeout_s = ranks, rank, device, timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the pool (see :meth:`_send`), waited for."""
        return self._send(method, *args)()

    def _send(self, method: str, *args: Any) -> Callable[[], Any]:
        """Rank 0 calls ``method(*args)`` on every rank of the pool now; the returned function waits
        for its rank 0's answer, which every training rank then has (every training rank must call
        it, at the same point of the step: the answer is broadcast). A dead, failed or silent pool
        rank raises :class:`ExecutorError` naming it, on every training rank."""
        refs = [getattr(r, method).remote(*args) for r in self.ranks] if self.rank == 0 else []
        return lambda: self._answer(method, refs)

    def _answer(self, method: str, refs: list[Any]) -> Any:
        import torch.distributed as dist

        answer, failure = None, None
        if self.rank == 0:
            try:
                answer = self._wait(method, refs)
            except ExecutorError as e:
                failure = str(e)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [(answer, failure)]
            device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else None
            dist.broadcast_object_list(box, src=0, device=device)
            answer, failure = box[0]
        if failure is not None:
            raise ExecutorError(failure)
        return answer

    def _wait(self, method: str, refs: list[Any]) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        answers = []
        for i, ref in enumerate(refs):
            label = f"{self.pool} rank {i}"
            try:
                answers.append(ray.get(ref, timeout=self.timeout_s))
            except RayActorError as e:
                raise ExecutorError(f"{label} died ({type(e).__name__}, in {method})") from None
            except GetTimeoutError:
                raise ExecutorError(f"{label} did not answer {method} within {self.timeout_s:.0f} s") from None
            except RayTaskError as e:
                cause = e.cause if e.cause is not None else e
                raise ExecutorError(f"{label} failed in {method}: {type(cause).__name__}: {cause}") from None
        return answers[0]

    def _tensor(self, wire: Any) -> torch.Tensor:
        return from_wire(wire).to(self.device)


class RemoteCritic(_RemoteRole):
    """The critic on its own pool (:class:`~purerl.step.roles.CriticRole`)."""

    pool = "critic"

    def values(self, params: Any, seqs: Any, *, batching: Any) -> torch.Tensor:
        return self._tensor(self._call("values", to_wire(seqs), batching))

    def update(self, params: Any, opt_state: Any, batch: Any, *, optimizer: Any, loss: Any, batching: Any,
               rng: RngState) -> tuple[None, None, Mapping[str, float]]:
        return None, None, _Answer(self._send("update_critic", to_wire(batch), optimizer, loss, batching, rng))


class RemoteReference(_RemoteRole):
    """The reference on its own pool (:class:`~purerl.step.roles.ReferenceRole`)."""

    pool = "reference"

    def logprobs(self, params: Any, seqs: Any, *, temperature: float, batching: Any) -> torch.Tensor:
        return self._tensor(self._call("reference_logprobs", to_wire(seqs), temperature, batching))


class RemoteTeacher(_RemoteRole):
    """A distillation teacher on the reference's pool (:class:`~purerl.step.roles.TeacherRole`)."""

    pool = "reference"

    def scores(self, seqs: Any, *, temperature: float, batching: Any, top_k: int | None) -> Any:
        out = from_wire(self._call("teacher_scores", to_wire(seqs), temperature, batching, top_k))
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, out)
