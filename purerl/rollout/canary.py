"""The weight-sync canary: after an engine loads a version, its log-probs of a fixed sequence must
equal the trainer's under that version's params.

Weights that were not applied, or arrived corrupted (a LoRA adapter binding no module, a tensor
scrambled or cut on the way, a stale prepacked copy), sample from another policy than the one
trained, silently. The check is one greedy token after a fixed prompt on the engine (the log-prob
every backend returns with its tokens, untempered for greedy decoding: one prefill) and one forward of
the same ids through the trainer's model with the published params: two passes over the weights at
a handful of tokens, cheap enough to run on every sync (BENCHMARKS.md, "The weight-sync canary").
A scrambled, scaled or missing tensor moves the next-token distribution of any prompt, so one token
tells.
"""

import attrs
import torch

from purerl.models import CausalLM, Params, response_logprobs
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

__all__ = ["CANARY_PROMPT", "Canary", "CanaryError"]

CANARY_PROMPT = tuple(range(1, 9))
"""Token ids 1…8 (every vocabulary has them): any fixed ids do; what matters is that both sides read the same."""


class CanaryError(RuntimeError):
    """An engine's log-probs of the canary differ from the trainer's: its weights are not the version's."""


@attrs.frozen
class Canary:
    """The check bound to the trainer's model: ``tokens`` greedy tokens after ``prompt``, and the
    largest log-prob difference per token that passes, ``tolerance`` (nats; float32 engines agree
    to ~1e-3: the engine's decode kernels are not the trainer's; bfloat16 to ~1e-1)."""

    policy: CausalLM
    tokens: int = 1
    tolerance: float = 1e-2
    prompt: tuple[int, ...] = CANARY_PROMPT

    def gap(self, engine: RolloutEngine, params: Params, version: int) -> float:
        """The largest ``|log π_engine − log π_trainer|`` over the canary's tokens, the engine holding ``version``."""
        rollout = engine.generate([list(self.prompt)], SamplingParams(max_new_tokens=self.tokens, temperature=0.0, n=1),
                                  RngState(0), version=version)
        with torch.no_grad():
            trainer = response_logprobs(self.policy, params, rollout.sequences)
        engine_side = rollout.behaviour_logprobs.to(trainer.device)
        mask = rollout.sequences.response_mask.to(trainer.device)
        return float(((engine_side - trainer).abs() * mask).max()) if mask.any() else 0.0

    def check(self, engine: RolloutEngine, params: Params, version: int, name: str) -> None:
        """Raise :class:`CanaryError` (one line, naming the version and the engine) over the tolerance."""
        self.judge(self.gap(engine, params, version), version, name)

    def judge(self, gap: float, version: int, name: str) -> None:
        """Raise :class:`CanaryError` if ``gap`` (:meth:`gap`'s, here or in another process) is over the tolerance."""
        if not gap <= self.tolerance:
            raise CanaryError(f"weight sync check failed: engine {name} at weights version {version}: its log-probs "
                              f"of the canary differ from the trainer's by up to {gap:.3g} nats per token (tolerance "
                              f"{self.tolerance:g}): the weights did not arrive intact")
