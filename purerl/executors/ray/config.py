"""Where the Ray executor's workers run and how long the driver waits for them."""

import attrs

__all__ = ["PLACEMENTS", "RayConfig"]

PLACEMENTS = ("colocated", "split")


@attrs.frozen
class RayConfig:
    """Worker counts, placement, resources and timeouts.

    ``address``: None starts a local Ray instance (``ray.init()``); ``"auto"`` or ``"host:port"``
    joins a running cluster. ``reward_workers``: 0 scores on the driver, more spreads the reward
    function calls over that many CPU workers. ``reward_model``: a local HF reward-model folder
    (:class:`~purerl.rewards.model.RewardModel`) for ``score_model``: each reward worker loads it
    once, when it starts, and scores a contiguous shard (on a GPU when ``reward_gpus_per_worker``
    > 0); with no reward workers the driver loads it on first use and scores on its CPU (the folder
    must be at the same path on every node). ``step_timeout``/``sync_timeout`` bound one step /
    one weight sync; a rank that exceeds them ends the run.
    """

    train_ranks: int = 2
    rollout_workers: int = 1
    reward_workers: int = 0
    placement: str = "split"
    engine: str = "torch"
    address: str | None = None
    cpus_per_worker: float = attrs.field(default=1.0, converter=float)
    gpus_per_worker: float = attrs.field(default=0.0, converter=float)
    threads_per_worker: int = 1
    checksum: bool = False
    bucket_bytes: int = 64 << 20
    step_timeout: float = attrs.field(default=3600.0, converter=float)
    sync_timeout: float = attrs.field(default=600.0, converter=float)
    start_timeout: float = attrs.field(default=300.0, converter=float)
    reward_model: str | None = attrs.field(default=None, converter=attrs.converters.optional(str))
    reward_gpus_per_worker: float = attrs.field(default=0.0, converter=float)
    reward_batch_size: int = 16

    def __attrs_post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"RayConfig: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.train_ranks < 1 or (self.placement == "split" and self.rollout_workers < 1):
            raise ValueError("RayConfig: need ≥ 1 training rank and, for 'split', ≥ 1 rollout worker")
        if self.engine != "torch" and self.placement == "colocated":
            # vLLM sets up a process group of its own, which clashes with the training ranks' FSDP group
            raise ValueError(f"RayConfig: the {self.engine!r} engine runs on rollout workers (placement 'split')")

    @property
    def workers(self) -> int:
        """Actors in all: training ranks, rollout workers (split) and reward workers."""
        return self.train_ranks + (self.rollout_workers if self.placement == "split" else 0) + self.reward_workers

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_worker > 0 else "cpu"
